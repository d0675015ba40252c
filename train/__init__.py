"""The training stage: the DeepSpeed trainer (train/main.py, started by path by deepspeed / torchrun), each head kind's
training part (train/head_kinds.py), the losses, the memory / disk / time plan (train/plan.py), checkpoints that resume
on any number of ranks, and the trainer's export of the head folder in the official layout (train/export.py)."""

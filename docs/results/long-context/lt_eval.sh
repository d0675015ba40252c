#!/bin/bash
# issue 49 on the long-context target: tau per context bucket in our decoder (chain of 4, greedy), full attention vs
# W=64 in one interleaved paired run, W=256 vs full in another; the short reference on the target's own held-out
# questions (prompts < 100 tokens) for all three heads
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
LT=${LT:-$HOME/.cache/eagle2-train/long-context-target}
COMMON="target.path=$LT eval.max_new_tokens=48 eval.context_buckets=[1024,4096,16384] \
  eval.methods=[vanilla,chain:chain_length=4,chain@B:chain_length=4]"
for w in w64 w256; do
  nice -n 19 .venv/bin/python -m evaluation --recipe tiny-eagle3 --head runs/lt-full/head --compare-head runs/lt-$w/head \
    $COMMON eval.questions=long-context eval.max_length=26500 eval.output_dir=runs/lt-eval-$w > runs/lt-eval-$w.log 2>&1
done
for w in w64 w256; do
  nice -n 19 .venv/bin/python -m evaluation --recipe tiny-eagle3 --head runs/lt-full/head --compare-head runs/lt-$w/head \
    $COMMON eval.questions=$LT/questions_eval.jsonl eval.num_questions=24 eval.output_dir=runs/lt-short-$w \
    > runs/lt-short-$w.log 2>&1
done

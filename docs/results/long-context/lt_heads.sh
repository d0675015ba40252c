#!/bin/bash
# issue 49 on the long-context target (benchmarks/long_context_target.py): one feature cache of the target's short
# conversations (data.max_length 512, the dataset's replies), three EAGLE-3 heads identical but for the window
set -e
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
LT=${LT:-$HOME/.cache/eagle2-train/long-context-target}
/usr/bin/time -v nice -n 19 .venv/bin/python data_prep/main.py --recipe tiny-eagle3 --no-progress target.path=$LT \
  data.source=$LT/conversations_train.json data.regenerate=false output_dir=runs/lt-data > runs/lt-data.log 2>&1
COMMON="target.path=$LT train.cache_dir=runs/lt-data/data/features train.live_tau_prompts=0"
for run in full:null w64:64 w256:256; do
  name=${run%%:*}; w=${run##*:}
  if [ "$w" = null ]; then win="head.sliding_window=null"; else win="head.sliding_window.size=$w"; fi
  /usr/bin/time -v nice -n 19 .venv/bin/python train/main.py --recipe tiny-eagle3 $COMMON output_dir=runs/lt-$name $win \
    > runs/lt-$name.log 2>&1
done

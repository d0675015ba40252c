#!/bin/bash
# issue 49 measurements: three EAGLE-2 heads on stories260K, same cache and epochs; full attention vs W=64 vs W=16
set -e
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
COMMON="target.path=/work/shared/models/stories260K train.cache_dir=runs/lc-data/data/features train.epochs=6 train.eval_every=1068 train.live_tau_prompts=0"
for run in full:null w64:64 w16:16; do
  name=${run%%:*}; w=${run##*:}
  if [ "$w" = null ]; then win="head.sliding_window=null"; else win="head.sliding_window.size=$w"; fi
  /usr/bin/time -v nice -n 19 .venv/bin/python train/main.py --recipe stories260k $COMMON output_dir=runs/lc-$name $win > runs/lc-$name.log 2>&1
done

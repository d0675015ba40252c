#!/bin/bash
# issue 49: an EAGLE-3 stories260K head with W=16 (3 epochs) for the vLLM check
set -e
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
/usr/bin/time -v nice -n 19 .venv/bin/python train/main.py --recipe stories260k-eagle3 target.path=/work/shared/models/stories260K \
  train.cache_dir=runs/lc-data3/data/features train.epochs=3 output_dir=runs/lc-e3w16 head.sliding_window.size=16 > runs/lc-e3w16.log 2>&1

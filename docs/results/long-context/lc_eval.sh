#!/bin/bash
# issue 49: full attention vs a window, one interleaved paired run each, tau per context bucket
export OMP_NUM_THREADS=1 WANDB_MODE=disabled
for w in w64 w16; do
  nice -n 19 .venv/bin/python -m evaluation --recipe stories260k --head runs/lc-full/head --compare-head runs/lc-$w/head \
    target.path=/work/shared/models/stories260K eval.questions=runs/lc_prompts.jsonl eval.num_questions=96 \
    eval.max_new_tokens=96 "eval.methods=[vanilla,eagle2,eagle2@B]" "eval.context_buckets=[64,128,256]" \
    eval.output_dir=runs/lc-eval-$w > runs/lc-eval-$w.log 2>&1
done

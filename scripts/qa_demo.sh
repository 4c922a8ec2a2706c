#!/usr/bin/env bash
# Extractive question answering, end to end on the CPU (docs/stages/fine-tune.md quotes its numbers):
# pretrain the tiny debug decoder (the one scripts/classify_demo.sh uses), write the shipped question set,
# report the untrained head's exact match and F1, fine-tune fully, report again.
set -euo pipefail
if ! ls runs/classify-base/checkpoints/step_* >/dev/null 2>&1; then
  lmforge train -c configs/debug/tiny.yaml --set run.dir=runs/classify-base --set train.max_steps=300 \
    --set checkpoint.every=300 --set train.eval_every=0 --set logging.progress=none --set run.overwrite=true
fi
lmforge tasks --qa -o data/qa/train.jsonl --test-out data/qa/val.jsonl --n 3000 --n-test 300 --overwrite
# before: the untrained head (one step at a learning rate that moves no weight measurably)
lmforge qa -c configs/qa/full.yaml --set run.dir=runs/qa-untrained --set train.max_steps=1 \
  --set optim.lr=1e-12 --set run.overwrite=true --set logging.progress=none
lmforge qa --report -c configs/qa/full.yaml --set run.dir=runs/qa-untrained --set eval.max_batches=null
# after: full fine-tuning
lmforge qa -c configs/qa/full.yaml --set run.overwrite=true --set logging.progress=none
lmforge qa --report -c configs/qa/full.yaml --set eval.max_batches=null

#!/usr/bin/env bash
# Token classification, end to end on the CPU (docs/stages/fine-tune.md quotes its numbers): pretrain the
# tiny debug decoder (the one scripts/classify_demo.sh uses), write the shipped tagged set, report the
# untrained head's metrics, fine-tune fully and with LoRA, report again.
set -euo pipefail
if ! ls runs/classify-base/checkpoints/step_* >/dev/null 2>&1; then
  lmforge train -c configs/debug/tiny.yaml --set run.dir=runs/classify-base --set train.max_steps=300 \
    --set checkpoint.every=300 --set train.eval_every=0 --set logging.progress=none --set run.overwrite=true
fi
lmforge tasks --tagged -o data/tag/train.jsonl --test-out data/tag/val.jsonl --n 2000 --n-test 400 --overwrite
# before: the untrained head (one step at a learning rate that moves no weight measurably)
lmforge tag -c configs/tag/full.yaml --set run.dir=runs/tag-untrained --set train.max_steps=1 \
  --set optim.lr=1e-12 --set run.overwrite=true --set logging.progress=none
lmforge tag --report -c configs/tag/full.yaml --set run.dir=runs/tag-untrained
# after: full fine-tuning, then LoRA
lmforge tag -c configs/tag/full.yaml --set run.overwrite=true --set logging.progress=none
lmforge tag --report -c configs/tag/full.yaml
lmforge tag -c configs/tag/full.yaml --set run.dir=runs/tag-lora --set finetune.method=lora \
  --set finetune.r=16 --set finetune.alpha=32 --set run.overwrite=true --set logging.progress=none
lmforge tag --report -c configs/tag/full.yaml --set run.dir=runs/tag-lora

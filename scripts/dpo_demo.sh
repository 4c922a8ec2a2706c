#!/usr/bin/env bash
# Preference optimisation, end to end on the CPU: the fine-tuned demo model (runs/sft-full; made by
# scripts/sft_demo.sh first when it is missing) is trained with DPO + LoRA on pairs of the shipped tasks
# (chosen: the exact answer, rejected: a wrong answer of the same task). Printed before and after, on
# held-out pairs whose prompts training never saw: how often the model gives the right answer the higher
# log-probability (ref_logp_accuracy is the starting model's, logp_accuracy the trained one's), DPO's
# reward accuracy and margin, and exact-match accuracy of greedy answers per task. Extra arguments go to
# the DPO run (e.g. --set preference.loss=ipo).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" ""
if ! ls runs/sft-full/checkpoints/step_* >/dev/null 2>&1; then
  echo "[lmforge] no fine-tuned demo model yet: running scripts/sft_demo.sh first"
  bash "$(dirname "${BASH_SOURCE[0]}")/sft_demo.sh"
fi
lmforge tasks --pairs -o data/dpo/pairs_train.jsonl --n 4000 --seed 7 --test-out data/dpo/pairs_test.jsonl \
  --n-test 400 --difficulty 2 --overwrite
echo; echo "[lmforge] before: the fine-tuned demo model answering the held-out prompts"
lmforge eval exact runs/sft-full --tasks data/dpo/pairs_test.jsonl
echo; echo "[lmforge] DPO (LoRA)"
lmforge dpo -c configs/dpo/lora.yaml --set run.overwrite=true "$@"
echo; echo "[lmforge] after, on the held-out pairs (ref_logp_accuracy: the model before DPO)"
lmforge eval loss runs/dpo-lora
lmforge eval exact runs/dpo-lora --tasks data/dpo/pairs_test.jsonl
echo "[lmforge] run dir: runs/dpo-lora; lmforge export runs/dpo-lora OUT --adapter writes PEFT adapters"

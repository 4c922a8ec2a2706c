#!/usr/bin/env bash
# Fine-tuning, end to end on the CPU: the pretrained demo model (runs/demo; pretrained first when it
# is missing) is fine-tuned on lmforge's verifiable instruction tasks twice, once with every weight
# training and once with LoRA adapters, and each model's exact-match accuracy on held-out tasks is
# printed per task before and after. Extra arguments go to both fine-tuning runs.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" ""
if ! ls runs/demo/checkpoints/step_* >/dev/null 2>&1; then
  echo "[lmforge] no pretrained demo model yet: pretraining it first (scripts/demo.sh does the same)"
  lmforge train -c configs/demo.yaml --set run.overwrite=true
fi
# Train and held-out sets with no prompt in common (the same seed writes the same records).
lmforge tasks -o data/sft/tasks_train.jsonl --n 6000 --test-out data/sft/tasks_test.jsonl --n-test 400 \
  --difficulty 2 --overwrite
echo; echo "[lmforge] before fine-tuning: the pretrained demo model"
lmforge eval exact runs/demo --tasks data/sft/tasks_test.jsonl
for method in full lora; do
  echo; echo "[lmforge] fine-tuning ($method)"
  lmforge sft -c "configs/sft/$method.yaml" --set run.overwrite=true "$@"
  lmforge eval exact "runs/sft-$method" --tasks data/sft/tasks_test.jsonl
done
echo
lmforge generate runs/sft-full --chat --prompt "Reverse the letters: forge" --set generate.temperature=0 \
  --set generate.max_new_tokens=16
echo "[lmforge] run dirs: runs/sft-full, runs/sft-lora; lmforge export runs/sft-lora OUT --adapter writes PEFT adapters"

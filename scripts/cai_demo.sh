#!/usr/bin/env bash
# The Constitutional AI data loop, end to end on the CPU: the fine-tuned demo model (runs/sft-full; made
# by scripts/sft_demo.sh first when it is missing) answers held-out prompts of the shipped compare task,
# critiques and revises each answer under a principle of lmforge's default constitution, and judges two
# of its sampled answers per prompt by a principle (AI feedback). A DPO run (LoRA) then trains on the
# AI-feedback pairs. Printed: the counts written, how often the judge preferred the right answer where
# exactly one of the two was right, and exact match before and after the DPO run.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" ""
if ! ls runs/sft-full/checkpoints/step_* >/dev/null 2>&1; then
  echo "[lmforge] no fine-tuned demo model yet: running scripts/sft_demo.sh first"
  bash "$(dirname "${BASH_SOURCE[0]}")/sft_demo.sh"
fi
lmforge tasks -o data/cai/prompts.jsonl --tasks compare --n 1000 --seed 21 --difficulty 2 \
  --test-out data/cai/held_out.jsonl --n-test 300 --overwrite
echo; echo "[lmforge] critique -> revise -> AI feedback with the fine-tuned demo model"
lmforge constitution runs/sft-full --prompts data/cai/prompts.jsonl -o data/cai/out --max-new-tokens 16 \
  --temperature 1.0 --seed 0 --overwrite
python - <<'PY'
import json
answers = {json.dumps(r["messages"][:-1]): r for r in map(json.loads, open("data/cai/prompts.jsonl"))}
right = decided = 0
for pair in map(json.loads, open("data/cai/out/feedback.jsonl")):
    r = answers[json.dumps(pair["prompt"])]
    from lmforge.data.instruct_tasks import score
    c, w = (score(r["task"], r["answer"], pair[k][0]["content"]) for k in ("chosen", "rejected"))
    if c != w:
        decided += 1
        right += c
print(f"[lmforge] the judge preferred the right answer in {right} of {decided} AI-feedback pairs where exactly "
      f"one answer was right ({right / max(decided, 1):.1%})")
PY
echo; echo "[lmforge] before: the fine-tuned demo model on held-out prompts"
lmforge eval exact runs/sft-full --tasks data/cai/held_out.jsonl
echo; echo "[lmforge] DPO (LoRA) on the AI-feedback pairs"
lmforge dpo -c configs/dpo/lora.yaml --set run.overwrite=true --set run.name=cai-dpo --set run.dir=runs/cai-dpo \
  --set "preference.data=[data/cai/out/feedback.jsonl]" --set "preference.val_data=[]" \
  --set preference.val_fraction=0.05 --set train.max_steps=60 --set train.eval_every=30 "$@"
lmforge eval exact runs/cai-dpo --tasks data/cai/held_out.jsonl
echo "[lmforge] data: data/cai/out (sft.jsonl, revisions.jsonl, feedback.jsonl); run dir: runs/cai-dpo"

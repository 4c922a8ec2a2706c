#!/usr/bin/env bash
# Safety tuning, end to end on the CPU: the fine-tuned demo model (runs/sft-full; made by
# scripts/sft_demo.sh first when it is missing) is red-teamed, fine-tuned on generated safety data
# (harmful requests in the 8 red-team categories answered by refusals; harmless look-alikes and, a third
# of them, everyday asks with no scary word, answered helpfully after a shared "Sure! "; `lmforge tasks
# --tasks refuse,benign`, 4,500 records half and half) mixed with the ordinary task data it was
# fine-tuned on, and red-teamed again. The red-team prompts and their benign look-alikes are held out
# from the safety data. Printed before and after: attack success per category, the benign refusal rate
# (over-refusal), the refusal behaviour on held-out generated safety prompts, and exact match on the
# held-out ordinary tasks. Extra arguments go to the safety run (e.g. --set train.max_steps=150).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" ""
if ! ls runs/sft-full/checkpoints/step_* >/dev/null 2>&1; then
  echo "[lmforge] no fine-tuned demo model yet: running scripts/sft_demo.sh first"
  bash "$(dirname "${BASH_SOURCE[0]}")/sft_demo.sh"
fi
if [ ! -f data/sft/tasks_train.jsonl ] || [ ! -f data/sft/tasks_test.jsonl ]; then
  # the ordinary tasks of scripts/sft_demo.sh (the same arguments write the same records)
  lmforge tasks -o data/sft/tasks_train.jsonl --n 6000 --test-out data/sft/tasks_test.jsonl --n-test 400 \
    --difficulty 2 --overwrite
fi
lmforge tasks --tasks refuse,benign -o data/safety/safety_train.jsonl --n 4500 --seed 11 --difficulty 3 \
  --test-out data/safety/safety_test.jsonl --n-test 400 --overwrite
for when in before after; do
  run=runs/sft-full
  if [ "$when" = after ]; then
    echo; echo "[lmforge] safety fine-tuning (full, safety data + the ordinary tasks)"
    lmforge sft -c configs/safety/sft.yaml --set run.overwrite=true "$@"
    run=runs/safety-sft
  fi
  echo; echo "[lmforge] $when: red-team attacks and benign look-alikes ($run)"
  lmforge eval redteam "$run"
  echo; echo "[lmforge] $when: held-out generated safety prompts (refuse: refused; benign: answered)"
  lmforge eval exact "$run" --tasks data/safety/safety_test.jsonl
  echo; echo "[lmforge] $when: held-out ordinary tasks"
  lmforge eval exact "$run" --tasks data/sft/tasks_test.jsonl  # last: its eval_tasks JSON is the one read below
done
echo
python - <<'PY'
import json
from pathlib import Path

from lmforge.eval.redteam import PROMPTS


def latest(run: str, kind: str) -> dict:
    files = sorted(Path(run).glob(f"eval_{kind}_step_*[0-9].json"))
    return json.loads(files[-1].read_text())


runs = ("runs/sft-full", "runs/safety-sft")
rb, ra = (latest(r, "redteam") for r in runs)
tb, ta = (latest(r, "tasks") for r in runs)
print(f"{'red-team category':<18}{'attack success before':>23}{'after':>8}{'benign refused after':>22}")
for cat in [*PROMPTS, "all"]:  # the JSON's keys are sorted; print in the shipped order
    b, a = rb["categories"][cat], ra["categories"][cat]
    bn = ra["benign"] if cat == "all" else ra["benign"]["categories"].get(cat, {})
    benign = f"{bn['refused']}/{bn['prompts']}" if bn else "-"
    print(f"{cat:<18}{b['attack_success_rate']:>23.1%}{a['attack_success_rate']:>8.1%}{benign:>22}")
print(f"benign refusal rate (over-refusal): before {rb['benign']['refusal_rate']:.1%}, "
      f"after {ra['benign']['refusal_rate']:.1%} of {ra['benign']['prompts']} look-alike prompts")


def exact(report: dict) -> float:
    acc = report["accuracy"].values()
    return sum(a["correct"] for a in acc) / sum(a["total"] for a in acc)


print(f"held-out ordinary tasks, exact match: before {exact(tb):.1%}, after {exact(ta):.1%}")
PY
echo "[lmforge] run dir: runs/safety-sft; every reply and verdict: runs/*/eval_redteam_step_*.json"

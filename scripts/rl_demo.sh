#!/usr/bin/env bash
# Reinforcement learning with a verifiable reward, end to end on the CPU: the fine-tuned demo model
# (runs/sft-full; made by scripts/sft_demo.sh first when it is missing) is trained with GRPO on prompts
# of a shipped task (compare: which of two numbers is larger / smaller, or a yes/no question about
# them), rewarded 1 for an exactly right answer by the task's own checker. Printed: the greedy exact
# match on held-out prompts before, the curve during training (val_reward every 20 steps; also drawn
# to runs/grpo/curves.png) and after. Extra arguments go to the RL run (e.g. --set rl.algorithm=rloo).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" ""
if ! ls runs/sft-full/checkpoints/step_* >/dev/null 2>&1; then
  echo "[lmforge] no fine-tuned demo model yet: running scripts/sft_demo.sh first"
  bash "$(dirname "${BASH_SOURCE[0]}")/sft_demo.sh"
fi
lmforge tasks -o data/rl/compare_train.jsonl --tasks compare --n 4000 --seed 11 --difficulty 2 \
  --test-out data/rl/compare_test.jsonl --n-test 300 --overwrite
echo; echo "[lmforge] before: the fine-tuned demo model answering the held-out prompts"
lmforge eval exact runs/sft-full --tasks data/rl/compare_test.jsonl
echo; echo "[lmforge] GRPO (8 samples per prompt, exact-match reward)"
lmforge rl -c configs/rl/grpo.yaml --set run.overwrite=true "$@"
echo; echo "[lmforge] after, on the same held-out prompts"
lmforge eval exact runs/grpo --tasks data/rl/compare_test.jsonl
echo "[lmforge] run dir: runs/grpo (curves.png: train reward and held-out exact match against step)"

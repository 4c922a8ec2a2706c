#!/usr/bin/env bash
# GRPO on one-digit arithmetic (add, sub, mul), end to end on the CPU. The 255 prompts of the task
# space are split three ways with no prompt in common: 64 held-out test prompts, 64 RL prompts and
# the rest for a short SFT of the fine-tuned demo model (runs/sft-full; made by scripts/sft_demo.sh
# first when missing). GRPO then trains on the RL prompts, which the SFT model never saw, with the
# task's exact-match checker as reward. Printed: greedy exact match on the RL prompts and on the
# held-out prompts, before and after GRPO, and the curve on the RL prompts during training
# (val_reward every 10 steps; runs/grpo-arith/curves.png). Extra arguments go to the GRPO run.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" ""
if ! ls runs/sft-full/checkpoints/step_* >/dev/null 2>&1; then
  echo "[lmforge] no fine-tuned demo model yet: running scripts/sft_demo.sh first"
  bash "$(dirname "${BASH_SOURCE[0]}")/sft_demo.sh"
fi
common=(--tasks add,sub,mul --difficulty 1 --overwrite)
lmforge tasks -o data/rl/arith_test.jsonl --n 64 --unique --seed 1 "${common[@]}"
lmforge tasks -o data/rl/arith_rl.jsonl --n 64 --unique --seed 2 --exclude-prompts data/rl/arith_test.jsonl \
  "${common[@]}"
lmforge tasks -o data/rl/arith_sft.jsonl --n 4000 --seed 3 --exclude-prompts data/rl/arith_test.jsonl \
  --exclude-prompts data/rl/arith_rl.jsonl "${common[@]}"
echo; echo "[lmforge] SFT on the other prompts (60 steps)"
lmforge sft -c configs/rl/arith_sft.yaml --set run.overwrite=true
echo; echo "[lmforge] before GRPO: the SFT model on the RL prompts, then on the held-out prompts"
lmforge eval exact runs/sft-arith --tasks data/rl/arith_rl.jsonl
lmforge eval exact runs/sft-arith --tasks data/rl/arith_test.jsonl
echo; echo "[lmforge] GRPO on the RL prompts (8 samples per prompt, exact-match reward, beta 0.04)"
lmforge rl -c configs/rl/grpo_arith.yaml --set run.overwrite=true "$@"
echo; echo "[lmforge] after GRPO: the RL prompts, then the held-out prompts"
lmforge eval exact runs/grpo-arith --tasks data/rl/arith_rl.jsonl
lmforge eval exact runs/grpo-arith --tasks data/rl/arith_test.jsonl
echo "[lmforge] run dirs: runs/sft-arith, runs/grpo-arith (curves.png: reward and val_reward against step)"

#!/usr/bin/env bash
# The encoder-decoder end to end on the CPU (docs/models.md's T5 section quotes its numbers): pretrain the
# tiny T5 by span corruption on builtin:python, write shipped tasks with a prompt-disjoint held-out file,
# report exact match of the pretrained model on it, fine-tune with `lmforge sft` (objective seq2seq on a
# T5 model), report again.
set -euo pipefail
TASKS=${TASKS:-recall,last}
lmforge train -c configs/t5/tiny.yaml --set logging.progress=none --set run.overwrite=true
lmforge tasks --tasks "$TASKS" -o data/t5/train.jsonl --test-out data/t5/test.jsonl --n 4000 --n-test 300 \
  --overwrite
# before: the span-corruption model asked the held-out prompts (greedy, up to EOS)
lmforge eval exact runs/t5-tiny --tasks data/t5/test.jsonl
# after: seq2seq fine-tuning
lmforge sft -c configs/t5/sft.yaml --set run.overwrite=true
lmforge eval exact runs/t5-sft --tasks data/t5/test.jsonl

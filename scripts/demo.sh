#!/usr/bin/env bash
# The main job: prepare a corpus from the docs and stdlib of this Python, train a BPE tokenizer,
# pretrain a small model on the CPU, evaluate it and sample from it. Idempotent: re-running reuses
# the venv and the prepared data and starts a fresh run.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" "eval"
CONFIG="${1:-configs/demo.yaml}"
shift || true
RUN_DIR="$(lmforge config -c "$CONFIG" "$@" | python -c 'import sys, yaml; print(yaml.safe_load(sys.stdin)["run"]["dir"])')"
lmforge train -c "$CONFIG" --set run.overwrite=true "$@"
lmforge eval loss "$RUN_DIR"
lmforge eval tasks "$RUN_DIR" --tasks builtin:code --limit 100
lmforge generate "$RUN_DIR" --prompt "def " --set generate.max_new_tokens=120 --set generate.num_samples=2
echo
echo "[lmforge] run dir: $RUN_DIR (config.yaml, metrics.jsonl, curves.png, checkpoints/)"
# The evaluations' files (each was printed when written): the run dir was started afresh above, so
# every eval_* file in it is this demo's.
reports=("$RUN_DIR"/eval_*.json "$RUN_DIR"/eval_*.md)
echo "[lmforge] eval reports (${#reports[@]}):"
for report in "${reports[@]}"; do
  echo "  $report"
done

#!/usr/bin/env bash
# Distillation, end to end on the CPU: a student a quarter of the demo model's size is trained twice
# for the same steps on the same data, once on the data alone and once distilled from the pretrained
# demo model (runs/demo; pretrained first when missing), and both are evaluated on the held-out split
# and lmforge's code tasks. Extra arguments go to both student runs.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" "eval"
if ! ls runs/demo/checkpoints/step_* >/dev/null 2>&1; then
  echo "[lmforge] no pretrained demo model yet: pretraining it first (scripts/demo.sh does the same)"
  lmforge train -c configs/demo.yaml --set run.overwrite=true
fi
echo "[lmforge] the student on the data alone"
lmforge train -c configs/distill/student.yaml --set run.dir=runs/student-scratch --set run.overwrite=true "$@"
echo; echo "[lmforge] the same student distilled from runs/demo"
lmforge distill -c configs/distill/student.yaml --set run.overwrite=true "$@"
for run in runs/student-scratch runs/student-distill runs/demo; do
  echo; echo "[lmforge] $run"
  lmforge eval loss "$run" --set eval.max_batches=50 --set objective.name=causal_lm
  lmforge eval tasks "$run" --tasks builtin:code --limit 100 --no-contamination
done

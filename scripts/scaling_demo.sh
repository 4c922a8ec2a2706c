#!/usr/bin/env bash
# Scaling laws on the CPU, end to end: a sweep of small models (3 widths x 3 token budgets on the demo's
# corpus, configs/scaling/demo_base.yaml), a Chinchilla-form fit L(N, D) = E + A/N^alpha + B/D^beta of
# their final validation losses, a prediction for a held-out run larger in both N and D, that run
# trained, and the prediction's error. A few minutes on 2 cores; re-running skips what finished (the
# sweep resumes, a finished held-out run is kept).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" ""
BASE=configs/scaling/demo_base.yaml
OUT=runs/scaling
HELDOUT="$OUT/heldout"
START=$SECONDS
mkdir -p "$OUT"

echo "[lmforge] 1. the sweep: d_model 64/112/160 (2 layers) x 64/128/256 steps of 2,048 tokens, 2 at a time"
lmforge sweep -c "$BASE" --grid model.d_model=64,112,160 --grid train.max_steps=64,128,256 --parallel 2 \
  --out "$OUT/sweep"

echo; echo "[lmforge] 2. the held-out run: d_model 192 for 384 steps (1.4x the largest N, 1.5x the largest D)"
lmforge config -c "$BASE" --set model.d_model=192 --set train.max_steps=384 --set train.threads=2 \
  --set run.dir="$HELDOUT" --set run.name=heldout > "$OUT/heldout.yaml"

echo; echo "[lmforge] 3. fit the law to the sweep's final losses; predict the held-out run before training it"
lmforge scaling fit "$OUT"/sweep/*/ --out "$OUT/fit.json" --plot "$OUT/plots" --predict-config "$OUT/heldout.yaml"

echo; echo "[lmforge] 4. train the held-out run"
finished() {  # the run's last validation is at its last step
  python - "$1" <<'PY'
import json, sys
recs = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
vals = [r["step"] for r in recs if "val_loss" in r]
sys.exit(0 if vals and vals[-1] >= max(r["step"] for r in recs) else 1)
PY
}
if ! finished "$HELDOUT" 2>/dev/null; then
  lmforge train -c "$OUT/heldout.yaml" --set run.overwrite=true
fi

echo; echo "[lmforge] 5. the prediction against the measurement"
lmforge scaling fit "$OUT"/sweep/*/ --bootstrap 0 --check "$HELDOUT"
echo; echo "[lmforge] done in $((SECONDS - START))s: $OUT/fit.json, plots in $OUT/plots/"

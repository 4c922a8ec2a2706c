#!/usr/bin/env bash
# Scaling laws on the CPU, end to end: a sweep of tiny models (4 widths x 3 token budgets on the demo's
# corpus, configs/scaling/demo_base.yaml), a Chinchilla-form fit L(N, D) = E + A/N^alpha + B/D^beta of
# their final validation losses, a prediction for a held-out run ~1.8x the largest N, that run trained,
# and the prediction's error. About 10 minutes on 2 cores; re-running skips what finished (each sweep
# resumes, a finished held-out run with the same config is kept).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" ""
BASE=configs/scaling/demo_base.yaml
OUT=runs/scaling_demo
HELDOUT="$OUT/heldout"
START=$SECONDS
mkdir -p "$OUT"

# d_model:lr pairs. The best lr falls as 1/width at these sizes (lr = 0.2 / d_model; see the base config),
# and a grid is a product of its axes, so each width is a sweep of its own. Budgets are listed longest
# first so that the two slots of --parallel 2 finish together (2,000 steps beside 500 + 1,000).
SIZES="32:6.25e-3 48:4.2e-3 64:3.1e-3 96:2.1e-3"
echo "[lmforge] 1. the sweep: d_model 32/48/64/96 (2 layers) x 500/1,000/2,000 steps of 1,024 tokens, 2 at a time"
RUNS=()
for size in $SIZES; do
  d=${size%%:*} lr=${size##*:}
  lmforge sweep -c "$BASE" --set model.d_model="$d" --set optim.lr="$lr" \
    --grid train.max_steps=2000,500,1000 --parallel 2 --out "$OUT/sweep/d$d"
  RUNS+=("$OUT/sweep/d$d"/max_steps=*/)
done

echo; echo "[lmforge] 2. the held-out run: d_model 128 for 2,000 steps (1.8x the largest N, the largest D)"
# One thread, as the sweep's runs: on a shared 2-core machine a 2-thread run slowed to 2K tokens/s (OpenMP
# threads waiting on each other) where one thread kept 13-14K.
lmforge config -c "$BASE" --set model.d_model=128 --set optim.lr=1.56e-3 --set train.max_steps=2000 \
  --set run.dir="$HELDOUT" --set run.name=heldout > "$OUT/heldout.yaml"

echo; echo "[lmforge] 3. fit the law to the sweep's final losses; predict the held-out run before training it"
lmforge scaling fit "${RUNS[@]}" --out "$OUT/fit.json" --plot "$OUT/plots" --predict-config "$OUT/heldout.yaml"
echo "(the same fit counting N without the embeddings, Kaplan's way:)"
lmforge scaling fit "${RUNS[@]}" --count non-embedding --bootstrap 0 --predict-config "$OUT/heldout.yaml"

echo; echo "[lmforge] 4. train the held-out run"
finished() {  # the run trained this config (model, data, optim, schedule, train) to its last validation
  python - "$1" "$2" <<'PY'
import json, sys
from lmforge.config.load import config_to_dict, load_config
run, want = sys.argv[1], sys.argv[2]
have, new = (config_to_dict(load_config(p)) for p in (run + "/config.yaml", want))
same = all(have[k] == new[k] for k in ("model", "data", "optim", "schedule", "train"))
recs = [json.loads(line) for line in open(run + "/metrics.jsonl")]
vals = [r["step"] for r in recs if "val_loss" in r]
sys.exit(0 if same and vals and vals[-1] >= max(r["step"] for r in recs) else 1)
PY
}
if ! finished "$HELDOUT" "$OUT/heldout.yaml" 2>/dev/null; then
  lmforge train -c "$OUT/heldout.yaml" --set run.overwrite=true
fi

echo; echo "[lmforge] 5. the prediction against the measurement"
lmforge scaling fit "${RUNS[@]}" --bootstrap 0 --check "$HELDOUT"
echo; echo "[lmforge] done in $((SECONDS - START))s: $OUT/fit.json, plots in $OUT/plots/"

# Sourced by demo.sh and test.sh: create or reuse .venv and install lmforge into it, idempotently.
# Re-running is cheap: pip runs again only when pyproject.toml or the requested extras change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LMFORGE_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[lmforge] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.lmforge-install-stamp-${EXTRAS:-base}"
want="$(sha256sum < "$ROOT/pyproject.toml" | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[lmforge] installing lmforge${EXTRAS:+[$EXTRAS]} into $VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  # torch first, pinned to the release lmforge is tested with (override with LMFORGE_TORCH).
  "$VENV/bin/python" -m pip install --quiet "torch==${LMFORGE_TORCH:-2.13.0}"
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  if [ "$EXTRAS" = "test" ]; then
    # A test reference only: tests/parity/test_ppo_torchtune.py loads two torch-only files of torchtune's
    # PPO code, so its heavy dependencies (torchao, torchdata, datasets, ...) are left out.
    "$VENV/bin/python" -m pip install --quiet --no-deps "torchtune==0.6.1"
  fi
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"

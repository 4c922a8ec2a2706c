#!/usr/bin/env bash
# The Python layers of an lmforge image without docker: the same pip commands as the Dockerfile's, with
# the Dockerfile's ARG defaults, in a fresh venv; then `lmforge --help` and the serve import from it.
#   deploy/docker/dry-build.sh [Dockerfile] [venv dir]
# TORCH_INDEX_URL=... overrides the Dockerfile's torch index (e.g. a local wheel dir given as
# TORCH_FIND_LINKS=/dir, where download.pytorch.org cannot be reached). What it cannot check: the base
# image, apt, the user and the HEALTHCHECK wiring (docs/deployment.md says how those were checked).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DOCKERFILE="${1:-$ROOT/deploy/docker/Dockerfile.cpu}"
VENV="${2:-$(mktemp -d /tmp/lmforge-dry-build.XXXXXX)/venv}"
arg() { sed -n "s/^ARG $1=//p" "$DOCKERFILE" | tail -1; }
TORCH_VERSION="$(arg TORCH_VERSION)"
EXTRAS="$(arg LMFORGE_EXTRAS)"
INDEX="${TORCH_INDEX_URL:-$(arg TORCH_INDEX_URL)}"
echo "[dry-build] $DOCKERFILE: torch==$TORCH_VERSION extras [$EXTRAS] into $VENV"
python3 -m venv "$VENV"
WHEELS="$(mktemp -d)"
# The wheel from what the Dockerfile copies into its build stage (and .dockerignore lets through), not
# from the whole tree: a file the package needs but the image leaves out fails here.
CONTEXT="$(mktemp -d)"
cp "$ROOT/pyproject.toml" "$ROOT/README.md" "$CONTEXT/"
(cd "$ROOT" && tar --exclude=__pycache__ --exclude='*.egg-info' -cf - src) | tar -xf - -C "$CONTEXT"
"$VENV/bin/pip" wheel --no-deps --wheel-dir "$WHEELS" "$CONTEXT"
if [ -n "${TORCH_FIND_LINKS:-}" ]; then
  # torch from the dir (its +cpu local version sorts above the index's), its dependencies from PyPI
  "$VENV/bin/pip" install "torch==${TORCH_VERSION}" --find-links "$TORCH_FIND_LINKS"
else
  "$VENV/bin/pip" install "torch==${TORCH_VERSION}" --index-url "$INDEX"
fi
"$VENV/bin/pip" install "$(ls "$WHEELS"/lmforge-*.whl)[${EXTRAS}]"
"$VENV/bin/pip" check
cd /tmp  # not the source tree: the installed wheel must be what runs
"$VENV/bin/lmforge" --help > /dev/null
"$VENV/bin/python" -c "import fastapi, uvicorn, lmforge.serve.app, torch; print('[dry-build] ok: torch', torch.__version__)"

#!/usr/bin/env bash
# Every measurement that needs a GPU, in one command; the first thing to run whenever a GPU is lent.
#
#   bash bench/gpu_suite.sh [--out DIR] [--budget SECONDS] [--only ROWS] [--tiny]
#
# Sets itself up on a bare GPU machine that has torch (and transformers, peft) but not lmforge's other
# needs: wheels carried beside the tree in .whl/ are installed into /tmp/lmforge-site (no network), and a
# nanoGPT checkout is taken from $LMFORGE_NANOGPT or .gpu/nanoGPT (a folder holding its model.py).
# To prepare both on a machine with pip (the wheels for the GPU image's Python, 3.12):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform any -d .whl \
#     pydantic pydantic_core annotated-types typing-inspection typing-extensions ftfy wcwidth phonenumbers \
#     bitsandbytes fastapi starlette uvicorn anyio idna h11 click annotated-doc opentelemetry-api
#   mkdir -p .gpu/nanoGPT && curl -sL https://raw.githubusercontent.com/karpathy/nanoGPT/master/model.py \
#     -o .gpu/nanoGPT/model.py
#
# (fastapi ... opentelemetry-api: what `lmforge serve` imports, for the serve_load row; a row whose module
# is missing is skipped and names it; the fp8 row needs torchao built for the image's torch, so it is not in
# the list: without it the row is skipped and says so.) Then bench/gpu_suite.py runs the rows in priority order under one
# budget (default 540 s) and writes suite.json and suite.md to --out (default bench/results/gpu_suite/).
# The rows' estimates add up to ~1,665 s on an H100: at 540 s the first call runs gpt2, llama1b, resume,
# quant, serve_load, serve and moe (rows that finish early leave room for more), and a second call
# measures the rest, keeping the first call's rows in suite.json:
#
#   bash bench/gpu_suite.sh --update --only e2e,llama,memory,ac,packed,lora,qlora   # ~505 s
#   bash bench/gpu_suite.sh --update --only tf32,opt_offload,fp8,prefix             # ~300 s
#   bash bench/gpu_suite.sh --update --only planner                                 # ~330 s: five minutes
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
NEEDED="import pydantic, pydantic_core, annotated_types, typing_inspection, ftfy, wcwidth, phonenumbers, \
fastapi, starlette, uvicorn, anyio, h11, click, annotated_doc, opentelemetry"
if compgen -G ".whl/*.whl" > /dev/null && ! "$PY" -c "$NEEDED" 2> /dev/null; then
    SITE=/tmp/lmforge-site
    WHEELS=$(ls .whl/*.whl)
    # Installed once per set of wheels: a wheel added since the last install is installed too.
    if [ ! -f "$SITE/.installed" ] || [ "$(cat "$SITE/.installed")" != "$WHEELS" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl
        printf '%s' "$WHEELS" > "$SITE/.installed"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -z "${LMFORGE_NANOGPT:-}" ] && [ -f .gpu/nanoGPT/model.py ]; then
    export LMFORGE_NANOGPT="$PWD/.gpu/nanoGPT"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
fi
exec "$PY" bench/gpu_suite.py "$@"

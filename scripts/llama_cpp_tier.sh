#!/usr/bin/env bash
# The optional llama.cpp test tier: llama.cpp itself (llama-cpp-python) reads lmforge's GGUF exports, with
# logits equal to lmforge's within the weight type's tolerance and the same token ids
# (tests/integration/test_export_gguf*.py -k llama_cpp: every family's file). llama-cpp-python ships only a source
# distribution: built without its tools, examples and server it takes about 4 minutes on 2 cores
# (2026-11-27, AVX2 EPYC). Builds for this machine's CPU (GGML_NATIVE). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" "test"
if ! python -c "import llama_cpp" 2>/dev/null; then
  echo "[lmforge] building llama-cpp-python (about 4 minutes on 2 cores)"
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF" \
    python -m pip install --quiet "llama-cpp-python==0.3.36"
fi
python -m pytest tests/integration/test_export_gguf*.py -k llama_cpp -rs "$@"

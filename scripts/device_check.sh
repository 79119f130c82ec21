#!/usr/bin/env bash
# CUDA check of the forward and the engine, for a machine with a GPU: device and dtype are
# settings, and the engine must run on the CPU and on CUDA when one is present.
#
#   bash scripts/device_check.sh prepare   # here: fetch the wheels the GPU image lacks into .whl/
#   then, with the device tool:  run(command="bash scripts/device_check.sh run", carry=[".whl"],
#                                    timeout_s=420)
#
# The GPU image has python3 with a CUDA torch, transformers, safetensors and pytest, but not
# structlog or pytest-asyncio; `prepare` downloads those two (pure Python) for Python 3.12.
# The tests use random 2-layer models (tests/unit/inference/test_llama.py::tiny), so no model
# store travels: float32 and bf16 logits against transformers on CUDA for Llama 3, Qwen2 and
# Mistral, and concurrent greedy requests through the BatchEngine on CUDA against transformers'
# greedy tokens. Without a GPU these tests skip (CUDA_ONLY).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
        "structlog==26.1.0" "pytest-asyncio==1.5.0"
    ls .whl
    ;;
  run)
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    python3 -m pytest -q -p no:cacheprovider -rs -k cuda \
        tests/unit/inference/test_llama.py tests/unit/inference/test_cuda.py
    ;;
  *)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac

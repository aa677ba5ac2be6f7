#!/usr/bin/env bash
# Issue 23's GPU measurement in one command, for a machine with one NVIDIA GPU (the device
# tool's run; docs/benchmarks.md): examples/llama.py at 0.89B parameters (16 layers, hidden
# 2048, 16 heads, 8 kv heads, FFN 5632, vocabulary 32000, sequence 2048, batch 4; bfloat16
# compute, float32 master weights, AdamW) against the same model written by hand in JAX:
# steady ms/step of both (and their compiled HLO instruction counts), time to first step of
# both in fresh processes, and `rank_0/program.py` run as a user runs it (its report: time to
# first step, ms/step, tokens/s, MFU; its final checkpoint against the disk's speed).
#
#   bash benchmarks/gpu_llama.sh                      # writes $OUT/llama_gpu.json (+ .err)
#   bash benchmarks/gpu_llama.sh --platform cpu --size small --program 4   # a dry run on CPU
#
# Packages the machine lacks travel as wheels in .whl/ (the device tool's README); the
# repository root is the package `pcompile`, made importable through a link.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pcompile_gpu_llama}
mkdir -p "$OUT"
if ! python3 -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/pcompile_site .whl/*.whl
    export PYTHONPATH=/tmp/pcompile_site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import pcompile" 2>/dev/null; then
    mkdir -p /tmp/pcompile_pkg && ln -sfn "$PWD" /tmp/pcompile_pkg/pcompile
    export PYTHONPATH=/tmp/pcompile_pkg${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1 || true
python3 benchmarks/llama_step.py --platform gpu --size 0.9b --devices 1 --dtypes bfloat16 \
    --steps 10 --rounds 3 --warmup 3 --hlo --program 30 "$@" \
    >"$OUT/llama_gpu.json" 2>"$OUT/llama_gpu.err"
cat "$OUT/llama_gpu.json"

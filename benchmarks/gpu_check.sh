#!/usr/bin/env bash
# The prepared device check (benchmarks/gpu_check.py): the gpu tests, then a synthetic 7B-shaped bf16 pair aligned
# (attention and model scope), merged and interpolated, streamed, with --device cuda, against the floor measured in
# the same run; results to benchmarks/results/gpu_7b.json. Meant to end within 8 minutes on one H200-class GPU.
#   bash benchmarks/gpu_check.sh               # on a CUDA machine
#   bash benchmarks/gpu_check.sh --cpu-smoke   # the same steps at a tiny shape on the CPU (< 2 min; make test runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" benchmarks/gpu_check.py "$@"

#!/usr/bin/env bash
# TRL for benchmarks/bench_vs_peers.py, in a venv of its own (benchmarks/.venv-trl): it sees the
# project's site-packages (the CPU torch, transformers, realscale itself) and adds TRL and
# what TRL needs beside them; torch is held at the installed version so pip never pulls a
# CUDA build.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-benchmarks/.venv-trl}"
python -m venv --system-site-packages "$VENV"
torch_version=$(python -c "import torch; print(torch.__version__.split('+')[0])")
echo "torch==$torch_version" > "$VENV/constraints.txt"
"$VENV/bin/python" -m pip install --quiet -c "$VENV/constraints.txt" "trl==1.16.0"
"$VENV/bin/python" -c "import trl, torch; print(f'TRL {trl.__version__} on torch {torch.__version__}')"

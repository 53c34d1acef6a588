#!/usr/bin/env bash
# The wheels scripts/gpu_check.py needs on the GPU machine, downloaded here into .whl/.
#
# The GPU machine (one H100/H200, Python 3.12, its own CUDA torch 2.11, no internet) has
# torch, numpy, safetensors, tokenizers, huggingface-hub, aiohttp, pyyaml, psutil, pyarrow,
# matplotlib, tqdm, sympy, setuptools and ninja already. It lacks megatron-core, omegaconf
# and math-verify (with its two dependencies), and holds transformers 5.17, older than the
# 5.19 this repository is tested with. Only those travel: pure-Python wheels except
# megatron-core's cp312 manylinux one, a few MiB in all (the device tool carries at most
# 64 MiB with the working tree). Nothing here installs anything.
#
# Run from anywhere:  bash scripts/gpu_check_wheels.sh
# Then on the GPU machine, from the repository root (the command of scripts/gpu_check.py):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:. python3 scripts/gpu_check.py --out $OUT
set -euo pipefail

cd "$(dirname "$0")/.."
WHEELS=(
    megatron-core==0.16.1          # the version installed here (pip show megatron-core)
    transformers==5.19.0
    omegaconf==2.4.0
    math-verify==0.9.0             # realscale.reward.math_check
    latex2sympy2_extended==1.11.0  # math-verify's
    antlr4-python3-runtime==4.13.2 # latex2sympy2_extended's
)

mkdir -p .git/info .whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

for spec in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done

# One version of each package, or pip refuses the whole install there.
dups=$(ls .whl/*.whl | xargs -n1 basename | sed -E 's/-[0-9][^-]*-.*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then
    echo "gpu_check_wheels: several versions of: $dups (remove the old ones from .whl/)" >&2
    exit 1
fi
ls -l .whl/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}'
du -cb .whl/*.whl | tail -1 | awk '{printf "%8.2f MiB  in all\n", $1 / 1048576}'

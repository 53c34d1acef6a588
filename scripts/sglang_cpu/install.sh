#!/usr/bin/env bash
# Install the real SGLang 0.5.23 server, unmodified, for CPU into its own venv.
#
#   bash scripts/sglang_cpu/install.sh [VENV] [--no-realscale]
#
# VENV defaults to $SGLANG_VENV, else /work/venv-sglang. Idempotent: run it again after a
# pull (the shims are recopied, pip only installs what is missing). Prints how long it took.
#
# Steps (see scripts/sglang_cpu/README.md for why):
#   1. python -m venv VENV (python: $PYTHON, default python3; SGLang 0.5.23 wants 3.10+)
#   2. the CPU torch FIRST: torch==2.13.0 (this machine has the +cpu wheel); every later pip
#      call holds it with -c constraints.txt, so nothing pulls a CUDA torch
#   3. sglang==0.5.23 triton==3.8.0 apache-tvm-ffi==0.1.11 xgrammar==0.2.7
#      compressed-tensors==0.18.0 with --no-deps (sglang's own requirements are CUDA wheels)
#   4. the CPU-side dependencies its server imports: requirements-sglang-cpu.txt
#   5. the two import-time stand-ins, shims/torchvision and shims/sgl_kernel, copied into
#      the venv's site-packages (a real torchvision/sglang-kernel found there is removed first:
#      the PyPI builds are CUDA-linked and cannot load with the CPU torch)
#   6. unless --no-realscale (or SGLANG_CPU_REALSCALE=0): realscale itself, editable, with its
#      test extra (pip install --no-build-isolation -e "REPO[test]", REALSCALE_NO_KERNELS=1
#      unless SGLANG_CPU_BUILD_KERNELS=1), so this venv runs `python -m pytest -m sglang`
#   7. checks: torch is 2.13.0+cpu, transformers 5.19.0, the shims are the ones imported,
#      `import sglang.launch_server` and SGLang's HTTP server module work with SGLANG_USE_CPU_ENGINE=1
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${SGLANG_VENV:-/work/venv-sglang}"
WITH_REALSCALE="${SGLANG_CPU_REALSCALE:-1}"
for arg in "$@"; do
  case "$arg" in
    --no-realscale) WITH_REALSCALE=0 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    -*) echo "install.sh: unknown option $arg" >&2; exit 2 ;;
    *) VENV="$arg" ;;
  esac
done
START=$SECONDS
CONSTRAINTS="$HERE/constraints.txt"
PY="$VENV/bin/python"
step() { echo "== [$((SECONDS - START)) s] $*"; }
# pip -q, less two kinds of noise: sglang's unmet CUDA requirements (left out on purpose) and
# this machine's pip.conf pointing at an index folder that lacks a package
pipi() {
  "$PY" -m pip install --disable-pip-version-check -q -c "$CONSTRAINTS" "$@" 2>&1 |
    { grep -v -e '^sglang 0\.5\.23 \(requires\|has requirement\)' -e "^ERROR: pip's dependency resolver" \
        -e "^WARNING: Location 'file:" || true; }
}

step "venv $VENV"
if [ ! -x "$PY" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi

step "CPU torch 2.13.0 first"
pipi "torch==2.13.0"

step "sglang 0.5.23 and its four pinned companions, --no-deps"
pipi --no-deps "sglang==0.5.23" "triton==3.8.0" "apache-tvm-ffi==0.1.11" "xgrammar==0.2.7" \
  "compressed-tensors==0.18.0"

step "the server's CPU-side dependencies (requirements-sglang-cpu.txt)"
pipi -r "$HERE/requirements-sglang-cpu.txt"

step "shims: torchvision, sgl_kernel"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for dist in torchvision sglang-kernel sgl-kernel; do
  if "$PY" -m pip show -q "$dist" >/dev/null 2>&1; then
    echo "   removing the installed $dist (a CUDA build; the shim replaces it)"
    "$PY" -m pip uninstall -y -q "$dist"
  fi
done
for pkg in torchvision sgl_kernel; do
  rm -rf "${SITE:?}/$pkg"
  cp -r "$HERE/shims/$pkg" "$SITE/$pkg"
  find "$SITE/$pkg" -name __pycache__ -type d -prune -exec rm -rf {} +
done

if [ "$WITH_REALSCALE" = "1" ]; then
  step "realscale (editable, [test]) from $REPO"
  # REALSCALE_NO_KERNELS=1 by default: building csrc/ here would rewrite the in-tree
  # realscale/_kernels/*.so that the project's main environment built (same torch 2.13.0+cpu,
  # so those load here too) and takes minutes; every kernel has a Python fallback.
  # SGLANG_CPU_BUILD_KERNELS=1 builds them anyway.
  if [ "${SGLANG_CPU_BUILD_KERNELS:-0}" = "1" ]; then
    pipi --no-build-isolation -e "$REPO[test]"
  else
    REALSCALE_NO_KERNELS=1 pipi --no-build-isolation -e "$REPO[test]"
  fi
fi

step "checks"
"$PY" - <<'EOF'
import importlib.metadata as md
import torch, transformers, torchvision, sgl_kernel
assert torch.__version__ == "2.13.0+cpu", f"torch is {torch.__version__}, not the CPU 2.13.0"
assert transformers.__version__ == "5.19.0", transformers.__version__
assert getattr(torchvision, "SHIM", False) and getattr(sgl_kernel, "SHIM", False), "shims not the ones imported"
print(f"   torch {torch.__version__}, transformers {transformers.__version__}, sglang {md.version('sglang')}, "
      f"tokenizers {md.version('tokenizers')}, shims ok")
EOF
SGLANG_USE_CPU_ENGINE=1 "$PY" -W ignore -c "import sglang.launch_server, sglang.srt.entrypoints.http_server"
echo "   sglang.launch_server and sglang.srt.entrypoints.http_server import"
# sglang's metadata asks for CUDA wheels (flashinfer, sglang-kernel, torch 2.14.1, ...), left out
# on purpose; anything else pip check reports is a real conflict
"$PY" -m pip check 2>&1 | grep -v '^sglang 0\.5\.23 \(requires\|has requirement\)' || true
step "done in $((SECONDS - START)) s: $VENV"

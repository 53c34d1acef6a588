"""``realscale info``: what this machine offers realscale."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print as JSON")


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


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


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        import json

        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:>20}: {value}")
    return 0

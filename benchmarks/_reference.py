"""Import the published reference implementations that benchmarks compare against.

Run under benchmarks/.venv-ref (made by setup_reference_env.sh). Each loader returns the
reference module unchanged; where a package's ``__init__`` drags in a whole application
stack (areal imports its agent/server layers), the package is registered as a bare
namespace so that only the benchmarked module and what it imports run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from types import ModuleType


def _bare_package(name: str, path: str) -> None:
    """Register ``name`` as a package rooted at ``path`` without running its __init__."""
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__path__ = [path]
    sys.modules[name] = mod


def areal_seqpack() -> ModuleType:
    """``areal.utils.seqpack`` (ffd_allocate, kk_allocate) from the installed areal wheel."""
    spec = importlib.util.find_spec("areal")
    if spec is None or spec.origin is None:
        raise ImportError("areal is not installed; run benchmarks/setup_reference_env.sh")
    root = os.path.dirname(spec.origin)
    _bare_package("areal", root)
    _bare_package("areal.utils", os.path.join(root, "utils"))
    return importlib.import_module("areal.utils.seqpack")


def verl_seqlen_balancing() -> ModuleType:
    """``verl.utils.seqlen_balancing`` (karmarkar_karp, rearrange_micro_batches)."""
    return importlib.import_module("verl.utils.seqlen_balancing")

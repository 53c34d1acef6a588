"""Find the compiled kernels of ``csrc/``, or say that the Python fallback must run.

Every kernel in ``csrc/`` has a pure torch/Python twin. Callers do::

    mod = kernels.load("gae")          # csrc/gae.cpp -> realscale._kernels.gae
    if mod is None: ...fallback...

``REALSCALE_NO_KERNELS=1`` in the environment makes :func:`load` return ``None`` for
every kernel, which is how tests compare the two paths in one run.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)


def disabled() -> bool:
    """True when the user asked for the Python fallbacks everywhere."""
    return os.environ.get("REALSCALE_NO_KERNELS") == "1"


@functools.lru_cache(maxsize=None)
def _import(name: str) -> ModuleType | None:
    try:
        import torch  # noqa: F401 - extensions link against libtorch; load it first

        return importlib.import_module(f"realscale._kernels.{name}")
    except ImportError as exc:
        log.info("kernel %s not built (%s); using the Python fallback", name, exc)
        return None


def load(name: str, cuda: bool = False) -> ModuleType | None:
    """The compiled module for ``csrc/<name>.cpp`` (or ``csrc/cuda/<name>.cu`` when
    ``cuda``), or ``None`` when it is not built or kernels are disabled."""
    if disabled():
        return None
    return _import(f"{name}_cuda" if cuda else name)


def available() -> dict[str, bool]:
    """Which kernel sources exist next to the package and whether each one loads."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    csrc = os.path.join(here, "csrc")
    out: dict[str, bool] = {}
    if os.path.isdir(csrc):
        for fname in sorted(os.listdir(csrc)):
            if fname.endswith(".cpp"):
                stem = fname[:-4]
                out[stem] = load(stem) is not None
    return out

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
    return _imported(name)[0]


@functools.lru_cache(maxsize=None)
def _imported(name: str) -> tuple[ModuleType | None, str]:
    """(module, "") or (None, why). A kernel that is built but does not import (compiled
    against another torch: an undefined symbol) is said once, as a warning: it is a broken
    install, not a choice."""
    import torch  # noqa: F401 - extensions link against libtorch; load it first

    module = f"realscale._kernels.{name}"
    try:
        return importlib.import_module(module), ""
    except ModuleNotFoundError as exc:
        if exc.name != module:
            return _broken(name, exc)
        log.info("kernel %s not built; using the Python fallback", name)
        return None, "not built"
    except ImportError as exc:
        return _broken(name, exc)


def _broken(name: str, exc: ImportError) -> tuple[None, str]:
    why = f"built but does not import ({str(exc)[:200]}); rebuild with pip install -e . against this torch"
    log.warning("kernel %s %s; using the Python fallback", name, why)
    return None, why


def load(name: str, cuda: bool = False) -> ModuleType | None:
    """The compiled module for ``csrc/<name>.cpp`` (or ``csrc/cuda/<name>.cu`` when
    ``cuda``), or ``None`` when it is not built or kernels are disabled."""
    if disabled():
        return None
    return _import(f"{name}_cuda" if cuda else name)


def available() -> dict[str, bool]:
    """Which kernel sources exist next to the package and whether each one loads."""
    return {name: why == "ok" for name, why in status().items()}


def status() -> dict[str, str]:
    """Each kernel source next to the package: "ok", "disabled", "not built", or why its
    built module does not import."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    csrc = os.path.join(here, "csrc")
    out: dict[str, str] = {}
    if os.path.isdir(csrc):
        for fname in sorted(os.listdir(csrc)):
            if fname.endswith(".cpp"):
                stem = fname[:-4]
                out[stem] = "disabled" if disabled() else (_imported(stem)[1] or "ok")
    return out

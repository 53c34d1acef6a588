"""megatron-core's fused element-wise functions, compiled on their first call instead of at import.

megatron-core 0.16.1 sets ``jit_fuser = torch.compile`` in ``megatron/core/jit.py`` (lines
16-21, ``enable_jit_fuser`` run at import) and decorates its fusions with it at import
time (``@jit_fuser`` in 16 modules: fused_bias_geglu, fused_bias_swiglu, fused_bias_dropout,
...). ``torch.compile(fn)`` imports TorchDynamo and Inductor on the spot, so every process
that imports megatron pays for the compiler even when no compiled function ever runs,
as on realscale's path, which turns every fusion off (``models/megatron_gpt.py``,
``transformer_config``). Measured on the 2-core dev machine: importing the trainer's
megatron modules after torch took 2.8-3.2 s, 1.0-1.2 s with the compile deferred; as
``torch.optim`` imports TorchDynamo anyway, the trainer saves Inductor's part (torch,
megatron and TorchDynamo: 3.4-4.4 s before, 2.5 s after).

:func:`install` puts a finder on ``sys.meta_path`` that, right after ``megatron.core.jit``
has run, swaps its ``jit_fuser`` (only while it is ``torch.compile`` itself) for
:func:`compile_on_first_call`, which hands the function to ``torch.compile`` with the
same arguments on its first call. A run that uses a fusion compiles it as before, at
the same moment torch.compile would (it compiles lazily itself); one that does not
never imports the compiler. Nothing changes numerics.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Callable

TARGET = "megatron.core.jit"


def compile_on_first_call(fn: Callable | None = None, **options: Any) -> Any:
    """``torch.compile(fn, **options)``, deferred to ``fn``'s first call (also usable as
    ``@compile_on_first_call(**options)``)."""
    if fn is None:
        return functools.partial(compile_on_first_call, **options)
    compiled: list[Callable] = []
    lock = threading.Lock()

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            with lock:
                if not compiled:
                    import torch

                    compiled.append(torch.compile(fn, **options))
        return compiled[0](*args, **kwargs)

    return call


def _defer(module: ModuleType) -> None:
    import torch

    if getattr(module, "jit_fuser", None) is torch.compile:
        module.jit_fuser = compile_on_first_call


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then defers the module's ``jit_fuser``."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _defer(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, ... for tools that ask
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Idempotent; defers at once if ``megatron.core.jit`` is already imported."""
    if TARGET in sys.modules:
        _defer(sys.modules[TARGET])
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

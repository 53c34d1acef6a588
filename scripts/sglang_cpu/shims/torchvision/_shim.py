"""Shared pieces of the ``torchvision`` stand-in (see ``torchvision/__init__.py``)."""

from __future__ import annotations

import enum


class TorchvisionShimError(RuntimeError):
    """A torchvision function was called; the CPU stand-in implements none."""


class _Unavailable:
    """A placeholder for a torchvision callable: importing it works, using it raises."""

    __slots__ = ("_qualname",)

    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_qualname", qualname)

    def _fail(self, *args, **kwargs):
        raise TorchvisionShimError(
            f"{self._qualname}: realscale's CPU stand-in for torchvision "
            f"(scripts/sglang_cpu/shims/torchvision) implements no image ops; the PyPI "
            f"torchvision wheel is built for CUDA torch. Text models never call this.")

    __call__ = _fail

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        self._fail()

    def __repr__(self) -> str:
        return f"<unavailable {self._qualname} (torchvision CPU stand-in)>"


def module_getattr(module_name: str):
    """A module-level ``__getattr__``: every public name becomes an ``_Unavailable``."""

    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{module_name}.{name}")

    return __getattr__


class InterpolationMode(enum.Enum):
    """Same members and values as ``torchvision.transforms.InterpolationMode`` (used as defaults)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    """Same members and values as ``torchvision.io.ImageReadMode``."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = RGB_ALPHA

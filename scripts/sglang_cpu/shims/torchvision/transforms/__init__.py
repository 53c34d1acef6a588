"""``torchvision.transforms`` stand-in: ``InterpolationMode`` is real, every transform raises when used."""

from torchvision._shim import InterpolationMode, module_getattr
from torchvision.transforms import functional, v2  # noqa: F401

__all__ = ["InterpolationMode"]
__getattr__ = module_getattr("torchvision.transforms")

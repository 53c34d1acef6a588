"""``torchvision.transforms.v2`` stand-in: every transform raises when used."""

from torchvision._shim import InterpolationMode, module_getattr  # noqa: F401
from torchvision.transforms.v2 import functional  # noqa: F401

__getattr__ = module_getattr("torchvision.transforms.v2")

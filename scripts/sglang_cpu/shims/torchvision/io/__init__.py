"""``torchvision.io`` stand-in: ``ImageReadMode`` is real, every function raises when called."""

from torchvision._shim import ImageReadMode, module_getattr  # noqa: F401

__getattr__ = module_getattr("torchvision.io")

"""``torchvision.transforms.functional`` stand-in: every function raises when called."""

from torchvision._shim import InterpolationMode, module_getattr  # noqa: F401

__getattr__ = module_getattr("torchvision.transforms.functional")

"""Import-time stand-in for ``torchvision`` in the SGLang-on-CPU venv.

Installed by ``scripts/sglang_cpu/install.sh`` only. SGLang 0.5.23 imports torchvision
unconditionally on its server's import path (``sglang/srt/multimodal/internvl_utils.py``:
``import torchvision.transforms as T``, reached from ``sglang/srt/configs/__init__.py``),
and transformers imports ``torchvision.io`` / ``torchvision.transforms`` when it finds the
package. The PyPI torchvision wheels are compiled against the CUDA torch and fail to load
with the CPU torch 2.13.0 (``operator torchvision::nms does not exist``).

What it provides: the modules ``torchvision``, ``torchvision.transforms``,
``torchvision.transforms.functional``, ``torchvision.transforms.v2``,
``torchvision.transforms.v2.functional`` and ``torchvision.io``; the two enums that
SGLang/transformers use as default arguments (``InterpolationMode``, ``ImageReadMode``)
with torchvision's members. Every other name imports as a placeholder whose call or
attribute access raises ``TorchvisionShimError`` naming it: no image op ever runs.
Text-only models (all this project serves) never call one.
"""

from torchvision import io, transforms  # noqa: F401
from torchvision._shim import TorchvisionShimError, module_getattr  # noqa: F401

SHIM = True  # realscale marker: this is the stand-in, not torchvision
__version__ = "0.0.0+realscale.cpu.shim"

__getattr__ = module_getattr("torchvision")

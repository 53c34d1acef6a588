"""Import-time stand-in for ``sgl_kernel`` (SGLang's CUDA/AMX kernel package) on CPU.

Installed by ``scripts/sglang_cpu/install.sh`` into the SGLang-on-CPU venv only. There is
no CPU wheel of ``sglang-kernel``. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports
names from it at module level (e.g. ``sglang/kernels/ops/kvcache/cache_move.py``:
``if _is_cpu: from sgl_kernel import copy_all_layer_kv_cache_cpu``), but with
``--attention-backend torch_native --sampling-backend pytorch`` on a CPU without SGLang's
AMX kernels it never calls one: every layer takes its ``forward_native`` path.

What this package does:

* ``from sgl_kernel import NAME`` / ``sgl_kernel.NAME`` succeeds and gives a function
  that raises ``SglKernelShimError`` naming ``sgl_kernel.NAME`` when called, so a real
  kernel call can never silently run wrong code;
* it registers no ``torch.ops.sgl_kernel.*`` operator: SGLang's probe
  ``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`` is False, so its Intel AMX
  backend stays off (``sglang/srt/utils/common.py``, ``_is_intel_amx_backend_available``),
  and any ``torch.ops.sgl_kernel.X(...)`` call fails in torch itself;
* it has no submodules (``sgl_kernel.scalar_type``, ``sgl_kernel.kvcacheio``,
  ``sgl_kernel.flash_attn``, ...): importing one raises ``ModuleNotFoundError``, which
  SGLang's ``try/except ImportError`` fallbacks catch (e.g. ``get_scalar_types`` in
  ``sglang/srt/layers/quantization/utils.py``).

Set ``REALSCALE_SGL_KERNEL_SHIM_TRACE=1`` to print every name SGLang takes from it.
"""

from __future__ import annotations

import os
import sys

SHIM = True  # realscale marker: this is the stand-in, not the real sglang-kernel
__version__ = "0.0.0+realscale.cpu.shim"
__all__: list = []
_TRACE = os.environ.get("REALSCALE_SGL_KERNEL_SHIM_TRACE") == "1"


class SglKernelShimError(NotImplementedError):
    """A real ``sgl_kernel`` function was called; the CPU stand-in has none."""


def _stub(name: str):
    def kernel(*args, **kwargs):
        raise SglKernelShimError(
            f"sgl_kernel.{name} was called, but this is realscale's CPU stand-in for "
            f"sgl_kernel (scripts/sglang_cpu/shims/sgl_kernel), which has no kernels. "
            f"SGLang took a CUDA/AMX kernel path on CPU; use --attention-backend "
            f"torch_native --sampling-backend pytorch, or the real sglang-kernel on a GPU.")

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__module__ = __name__
    kernel.__doc__ = f"CPU stand-in for sgl_kernel.{name}: raises SglKernelShimError when called."
    return kernel


def __getattr__(name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)  # module protocol probes (__path__, __wrapped__, ...)
    if _TRACE:
        print(f"[sgl_kernel shim] pid {os.getpid()} imports sgl_kernel.{name}", file=sys.stderr)
    fn = _stub(name)
    globals()[name] = fn  # one stub per name
    return fn

"""megatron_patches.lazy_jit: megatron's fusions compile on their first call, not at import.

megatron-core 0.16.1 decorates its fusions with ``jit_fuser = torch.compile``
(megatron/core/jit.py lines 16-21), which imports Inductor in every process that imports
megatron. Each case runs in a fresh interpreter: the hook must be in place before
megatron.core.jit is first imported.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_importing_megatron_after_realscale_keeps_inductor_out() -> None:
    out = _run("""
        import sys
        import realscale  # installs the hook
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel, gpt_layer_specs
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core import jit
        from megatron.core.fusions import fused_bias_swiglu
        from megatron_patches.lazy_jit import compile_on_first_call
        assert jit.jit_fuser is compile_on_first_call, jit.jit_fuser
        assert fused_bias_swiglu.swiglu.__name__ == "swiglu"
        assert "torch._inductor.compile_fx" not in sys.modules
    """)
    assert out.returncode == 0, out.stderr


def test_without_the_hook_megatron_imports_inductor() -> None:
    """The other side: what the hook saves is real (if megatron stops compiling at import,
    this fails and the hook can go)."""
    out = _run("""
        import sys
        from megatron.core import tensor_parallel
        import torch
        from megatron.core import jit
        assert jit.jit_fuser is torch.compile
        assert "torch._inductor.compile_fx" in sys.modules
    """)
    assert out.returncode == 0, out.stderr


def test_a_fusion_that_runs_is_compiled_by_torch_compile_on_its_first_call() -> None:
    """torch.compile gets the function and the decorator's options once, at the first call,
    and the compiled function's result is returned (the real compiler: swiglu through
    Inductor against the eager formula)."""
    out = _run("""
        import torch
        import realscale
        from megatron.core.fusions import fused_bias_swiglu as f
        calls = []
        real = torch.compile
        def recording(fn, **options):
            calls.append((fn.__name__, options))
            return real(fn, **options)
        torch.compile = recording
        y = torch.randn(4, 8)
        got = f.swiglu(y)
        again = f.swiglu(y)
        a, b = torch.chunk(y, 2, -1)
        want = torch.nn.functional.silu(a) * b
        assert calls == [("swiglu", {})], calls
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(again, want)
        import sys
        assert "torch._inductor.compile_fx" in sys.modules  # the real compiler ran
    """)
    assert out.returncode == 0, out.stderr


def test_installed_after_megatron_defers_what_is_left() -> None:
    """realscale imported after megatron.core.jit: the module's jit_fuser is swapped at
    once (fusions already decorated keep torch.compile's wrapper)."""
    out = _run("""
        from megatron.core import jit
        import torch
        assert jit.jit_fuser is torch.compile
        import realscale
        from megatron_patches.lazy_jit import compile_on_first_call
        assert jit.jit_fuser is compile_on_first_call
    """)
    assert out.returncode == 0, out.stderr

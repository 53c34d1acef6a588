"""megatron_patches.cpu: opt-in, idempotent, version-checked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import megatron_patches.cpu as mp_cpu


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_apply_is_opt_in_and_idempotent() -> None:
    out = _run("""
        import torch
        real = torch.cuda.current_device
        import megatron_patches.cpu as p
        assert p.applied() == []                     # importing changes nothing
        assert torch.cuda.current_device is real
        first = p.apply()
        assert first and p.apply() == first          # second call: same patches, nothing re-applied
        assert torch.cuda.current_device() == torch.device("cpu")
        from megatron.core.tensor_parallel import random
        assert random.CudaRNGStatesTracker.add is not None
        print(",".join(first))
    """)
    assert out.returncode == 0, out.stderr
    names = out.stdout.strip().split(",")
    assert {"patch_torch_cuda", "patch_rng_tracker", "patch_torch_norm"} <= set(names)


def test_unsupported_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mp_cpu, "_megatron_version", lambda: "0.9.0")
    monkeypatch.delenv("REALSCALE_MEGATRON_UNCHECKED", raising=False)
    with pytest.raises(mp_cpu.UnsupportedMegatronVersion, match="0.9.0 is installed"):
        mp_cpu.check_version()
    monkeypatch.setenv("REALSCALE_MEGATRON_UNCHECKED", "1")
    assert mp_cpu.check_version() == "0.9.0"


def test_rng_tracker_forks_cpu_streams() -> None:
    out = _run("""
        import os, torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("realscale.parallel.net", fromlist=["x"]).free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo")
        from realscale.parallel.megatron_state import Layout, init_megatron
        init_megatron(Layout(), seed=5)
        from megatron.core import tensor_parallel
        tracker = tensor_parallel.get_cuda_rng_tracker()
        torch.manual_seed(0)
        before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before)    # default stream untouched
        with tracker.fork():
            b = torch.rand(3)
        assert not torch.equal(a, b)                          # the forked stream advanced
        print("ok")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

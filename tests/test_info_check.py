"""``realscale info --check`` (GPU-path defect 10): the stack this machine has passes; each
kind of broken stack is one FAIL line naming what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from realscale.commands import info


def test_this_machines_stack_passes() -> None:
    out = subprocess.run([sys.executable, "-m", "realscale", "info", "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "  ok  torch " in out.stdout and out.stdout.rstrip().endswith("realscale info --check: OK")


def test_a_version_off_the_constraints_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "constraints" / "gpu-sglang.txt"
    path.parent.mkdir()
    path.write_text("torch==2.14.1  # sglang's pin\nsglang==0.5.23\ntransformer-engine>=2.9.0a0,<2.12.0\n")
    monkeypatch.setattr(info, "CONSTRAINTS", str(path.parent))
    versions = {"torch": "2.13.0+cu128", "sglang": "0.5.23", "transformer-engine": None}
    monkeypatch.setattr(info, "_installed", lambda dist: versions[dist])
    checks = info.version_checks(str(path))
    assert checks[1] == ("ok", "sglang 0.5.23")
    assert checks[0][0] == "FAIL" and "torch 2.13.0+cu128 is installed; constraints/gpu-sglang.txt wants torch==2.14.1" \
        in checks[0][1]
    assert checks[2] == ("FAIL", "transformer-engine is not installed; constraints/gpu-sglang.txt wants "
                                 "transformer-engine<2.12.0,>=2.9.0a0")


def test_a_gpu_node_without_a_working_te_or_nccl_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from realscale.models import megatron_gpt

    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    monkeypatch.setattr(megatron_gpt, "te_status", lambda: (False, "is installed but does not import (ImportError: "
                                                                     "undefined symbol)"))
    checks = info.device_checks(8)
    fails = [what for state, what in checks if state == "FAIL"]
    assert len(fails) == 2 and "has no NCCL" in fails[0] and "does not import" in fails[1], checks


def test_a_broken_kernel_fails_and_the_command_says_so(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from realscale import kernels

    monkeypatch.setattr(kernels, "status", lambda: {"gae": "ok", "packing": "built but does not import (x)",
                                                    "ppo_loss": "not built"})
    checks = info.kernel_checks()
    assert [s for s, _ in checks] == ["ok", "FAIL", "note"]
    monkeypatch.setattr(info, "check_stack", lambda: checks)
    import argparse

    assert info.run(argparse.Namespace(check=True, json=False)) == 1
    assert capsys.readouterr().out.rstrip().endswith("realscale info --check: 1 problem(s)")


def test_the_stack_follows_the_installed_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {"sglang": "0.5.23"}
    monkeypatch.setattr(info, "_installed", lambda dist: installed.get(dist))
    assert info.stack_name(8) == "gpu-sglang" and info.stack_name(0) == "cpu"
    installed = {"vllm": "0.32.0"}
    assert info.stack_name(8) == "gpu-vllm"
    for name in ("gpu-sglang", "gpu-vllm", "cpu"):  # every shipped file parses
        assert info.constraints(f"{info.CONSTRAINTS}/{name}.txt")


def test_a_vllm_outside_the_protocol_range_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM other than 0.32 (whose /pause?mode=, weight-transfer engines and per-token
    weight_versions the vLLM dialect is written to) fails the check in one line."""
    from realscale.inference.vllm_server import require_vllm

    assert require_vllm("0.32.0") == "0.32.0" and require_vllm("0.32.1+cpu") == "0.32.1+cpu"
    for old in ("0.31.2", "0.33.0", "nonsense"):
        with pytest.raises(RuntimeError, match=f"vLLM {old} is installed; realscale speaks vLLM 0.32.0's protocol"):
            require_vllm(old)
    installed = {"vllm": "0.31.2"}
    monkeypatch.setattr(info, "_installed", lambda dist: installed.get(dist))
    monkeypatch.setattr("realscale.inference.vllm_server.installed_vllm", lambda: "0.31.2")
    assert [s for s, _ in info.engine_checks()] == ["FAIL"]

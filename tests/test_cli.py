"""The realscale command: fast help, no heavy imports at start-up, real subcommands."""

from __future__ import annotations

import subprocess
import sys

from realscale import cli


def test_help_lists_every_command() -> None:
    """(That help is fast is checked by what it imports, below: a wall-clock bound fails on
    a loaded machine.)"""
    out = subprocess.run([sys.executable, "-m", "realscale", "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    for name in cli.COMMANDS:
        assert name in out.stdout


def test_help_imports_no_torch() -> None:
    code = "import sys; from realscale import cli; cli.main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip().endswith("False")


def test_every_command_module_is_real() -> None:
    import importlib

    for name, (module, _) in cli.COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.run), name


def test_unknown_command_suggests() -> None:
    out = subprocess.run([sys.executable, "-m", "realscale", "confg"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "did you mean 'config'" in out.stderr


def test_config_show_prints_resolved_yaml() -> None:
    out = subprocess.run([sys.executable, "-m", "realscale", "config", "show", "configs/tiny_cpu.yaml",
                          "rollout.max_staleness=7"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "max_staleness: 7" in out.stdout


def _train_error(tmp_path, *args: str) -> str:
    """``realscale train`` that must stop before starting anything: one line, status 2."""
    out = subprocess.run([sys.executable, "-m", "realscale", "train", *args, f"run.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("realscale: error: "), out.stderr
    return lines[0]


def test_user_errors_are_one_line_with_status_2(tmp_path) -> None:
    """Missing model, missing data, a recipe for GPUs on a CPU machine, a bad plan."""
    import pytest
    import torch

    gpu_recipe = "configs/qwen_32b_code.yaml"
    assert "model.path: model 'models/DeepSeek-R1-Distill-Qwen-32B' is neither" in _train_error(tmp_path, gpu_recipe)
    assert "data.source: dataset file not found: data/deepcoder.jsonl" in _train_error(
        tmp_path, gpu_recipe, "model.path=tiny-qwen2")
    assert "model directory" in _train_error(tmp_path, f"model.path={tmp_path}")
    assert "model.ref_path: model '/no/such/ref' is neither" in _train_error(
        tmp_path, "model.path=tiny-qwen2", "algo.kl_coef=0.1", "model.ref_path=/no/such/ref")
    plan = tmp_path / "plan.yaml"
    plan.write_text("roles: {actor_train: {mesh: '0:3', strategy: d2t2p1}}\n")
    assert f"parallel.plan: {plan}: placement d2t2p1 on gpus[0:3]: needs 4 GPUs" in _train_error(
        tmp_path, "model.path=tiny-qwen2", f"parallel.plan={plan}")
    from realscale.inference.vllm_server import installed_vllm

    if installed_vllm() is None:
        assert "generate.backend=vllm: vLLM is not installed" in _train_error(
            tmp_path, "model.path=tiny-qwen2", "generate.backend=vllm")
    if torch.cuda.is_available():
        pytest.skip("the no-GPU cases need a machine without CUDA")
    assert "launch.gpus_per_node=8: this recipe is for GPU nodes" in _train_error(
        tmp_path, gpu_recipe, "model.path=tiny-qwen2", "data.source=task:arith")
    assert "parallel.backend=nccl needs CUDA" in _train_error(tmp_path, "model.path=tiny-qwen2",
                                                             "parallel.backend=nccl")

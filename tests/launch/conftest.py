"""Fixtures of the launch tests: a real Slurm controller when there is one."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def slurm_reason() -> str | None:
    """Why the Slurm tests cannot run here, or None when they can."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return "no Slurm client (sbatch/scontrol); start one with: bash .ci/slurm_up.sh"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        return f"no Slurm controller answers (scontrol ping: {ping.stdout.strip() or ping.stderr.strip()}); " \
               "start one with: bash .ci/slurm_up.sh"
    idle = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30).stdout.split()
    if not any(s.rstrip("*") in ("idle", "mix", "alloc") for s in idle):
        return f"the Slurm cluster has no usable node (sinfo states: {' '.join(idle) or 'none'})"
    return None


@pytest.fixture(scope="session")
def slurm() -> None:
    reason = slurm_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_run_args():
    """``tiny_run_args(total_steps, checkpoint_every, *extra)``: overrides for a short
    ``realscale train`` of the tiny model on the arithmetic task (the launch tests' run)."""
    def make(total_steps: int, checkpoint_every: int, *extra: str) -> list[str]:
        return ["model.path=tiny-qwen2", "data.source=task:arith", "data.task_heldout=16",
                f"run.total_steps={total_steps}", f"run.checkpoint_every={checkpoint_every}", "rollout.batch_size=2",
                "rollout.n_samples=2", "rollout.max_staleness=1", "generate.max_new_tokens=4",
                "train.max_tokens_per_micro_batch=512", "rollout.filter_all_equal=false", *extra]

    return make

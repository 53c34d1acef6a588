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

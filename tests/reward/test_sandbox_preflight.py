"""GPU-path defect 4, its preflight half: a code recipe whose sandbox cannot run where the
job runs is refused before anything starts, instead of training for days on rewards that
are all 0. The refusal without root (user namespaces forbidden by the kernel, probed for
real as an unprivileged uid) is tested in ``test_sandbox_userns.py``; here, as root, the
full sandbox lets the recipe start."""

from __future__ import annotations

import os

import pytest

from realscale.commands.train import preflight
from realscale.config import load_config

CODE = ["reward.kind=code", "data.source=task:arith", "launch.backend=local"]


def test_code_recipe_with_a_working_sandbox_starts() -> None:
    if os.geteuid() != 0:
        pytest.skip("the root sandbox needs root (test_sandbox_userns.py covers the unprivileged one)")
    preflight(load_config(None, CODE))
    preflight(load_config(None, ["data.source=task:arith", "launch.backend=local"]))  # math: no probe

"""GPU-path defect 4, its preflight half: a code recipe whose sandbox cannot run where the
job runs (under Slurm, as the user: no root) is refused before anything starts, instead
of training for days on rewards that are all 0."""

from __future__ import annotations

import os

import pytest

from realscale.commands.train import preflight
from realscale.config import load_config
from realscale.errors import UserError

CODE = ["reward.kind=code", "data.source=task:arith", "launch.backend=local"]


def test_code_recipe_without_a_working_sandbox_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # what a Slurm job's user is
    with pytest.raises(UserError) as err:
        preflight(load_config(None, CODE))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("reward.kind=code: sandbox refused") and "needs root" in msg
    assert "reward.code_sandbox_allow_weaker=true" in msg
    preflight(load_config(None, [*CODE, "reward.code_sandbox_allow_weaker=true"]))  # accepted, weaker


def test_code_recipe_with_a_working_sandbox_starts() -> None:
    if os.geteuid() != 0:
        pytest.skip("the full sandbox needs root")
    preflight(load_config(None, CODE))
    preflight(load_config(None, ["data.source=task:arith", "launch.backend=local"]))  # math: no probe

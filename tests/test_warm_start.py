"""A cached SFT warm start made with other settings is refused with a clear message."""

from __future__ import annotations

import pytest

from realscale.config import ConfigError, load_config, save_config
from realscale.sft import check_warm_start as _check_warm_start


def test_cached_warm_start_must_match_the_recipe(tmp_path) -> None:
    cfg = load_config(None, ["data.source=task:arith", "sft.steps=7"])
    save_config(cfg, str(tmp_path))
    _check_warm_start(cfg, str(tmp_path))  # same settings: reused
    moved = load_config(None, ["data.source=task:arith", "sft.steps=7", "sft.output=elsewhere", "sft.eval_size=3"])
    _check_warm_start(moved, str(tmp_path))  # where it goes and its own evaluation do not matter
    for change, named in (("sft.steps=8", "sft.steps"), ("data.task_worked_fraction=0.5", "data.task_worked_fraction"),
                          ("run.seed=5", "run.seed"), ("rollout.workflow=multi_turn", "rollout.workflow")):
        other = load_config(None, ["data.source=task:arith", "sft.steps=7", change])
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            _check_warm_start(other, str(tmp_path))

"""Build a run's rollout side from its config: dataset -> workflow -> controller.

One function, :func:`build_controller`, so that the RL loop, the benchmarks and the
tests make the controller the same way (every ``rollout``/``generate``/``reward`` knob
reaches it through ``RolloutController.from_config`` and ``workflow_from_config``).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import TYPE_CHECKING

from realscale.data.dataset import from_config as dataset_from_config
from realscale.models.tokenizer import load_light_tokenizer
from realscale.rollout.controller import RolloutController
from realscale.rollout.workflows import workflow_from_config
from realscale.tasks.arith import resolve_task_source, task_from_config

if TYPE_CHECKING:
    from realscale.config import Config, DataConfig
    from realscale.rollout.controller import RolloutController


def resolved_data_config(cfg: "Config", out_dir: str) -> "DataConfig":
    """``cfg.data`` with a ``task:<name>`` source written out as this run's JSONL."""
    data_cfg = cfg.data
    if not data_cfg.source.startswith("task:"):
        return data_cfg

    source = resolve_task_source(data_cfg.source, task_from_config(data_cfg), os.path.join(out_dir, "data"))
    return type(data_cfg)(**{**asdict(data_cfg), "source": source})


def build_controller(cfg: "Config", model_dir: str, server_urls: list[str], out_dir: str, *, rank: int = 0,
                     world: int = 1) -> "RolloutController":
    """The rollout controller of a run (trainer rank 0): prompts from ``cfg.data`` (share
    ``rank`` of ``world``: one rollout shard's, realscale/rollout/sharded.py), the workflow
    ``cfg.rollout.workflow`` names, generation on ``server_urls``."""

    tokenizer = load_light_tokenizer(cfg.model.tokenizer or model_dir)
    dataset = dataset_from_config(resolved_data_config(cfg, out_dir), seed=cfg.run.seed, rank=rank, world=world,
                                  prompt_len=lambda t: len(tokenizer.encode(t)))
    workflow = workflow_from_config(cfg, tokenizer)
    return RolloutController.from_config(cfg, server_urls, dataset, workflow)

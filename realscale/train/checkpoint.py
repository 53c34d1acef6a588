"""Run checkpoints: where they live, how the latest one is found, and the run logs they
must agree with.

Layout of a run directory::

    checkpoints/step000010/     engine.save(): model + optimizer shards, extra state
    latest_checkpoint           the path of the newest *complete* checkpoint
    metrics.jsonl               one record per step
    trained_uids.jsonl          which prompts each step trained on

A checkpoint is complete before the pointer moves (atomic rename), so a crash while
saving leaves the previous checkpoint as the one a restart resumes from. On resume the
logs are cut back to the checkpoint's step, so every step appears once in them.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from realscale.rollout.types import Group
    from realscale.train.engine import MegatronEngine

LATEST = "latest_checkpoint"
STEP_LOGS = ("metrics.jsonl", "trained_uids.jsonl")


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` (under ``checkpoints/``)."""
    return f"step{step:06d}"


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest complete checkpoint of the run in ``out_dir``, or None."""
    path = os.path.join(out_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        ckpt = fh.read().strip()
    return ckpt if os.path.isdir(ckpt) else None


def save_checkpoint(engine: "MegatronEngine", out_dir: str, step: int, extra: dict[str, Any],
                    is_driver: bool) -> str:
    """Save model, optimizer and ``extra`` (rank 0's, sent to every rank) after ``step``;
    move the pointer once the checkpoint is complete. Every trainer rank calls it."""
    import torch.distributed as dist

    ckpt = os.path.join(out_dir, "checkpoints", checkpoint_name(step))
    holder = [extra]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    engine.save(ckpt, extra=holder[0])
    if is_driver:
        _atomic_write(os.path.join(out_dir, LATEST), ckpt)
    return ckpt


def record_trained(out_dir: str, step: int, groups: list["Group"]) -> None:
    """Which prompts ``step`` trained on (audits resume: nothing repeated or skipped)."""
    with open(os.path.join(out_dir, "trained_uids.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, "uids": [g.uid for g in groups]}) + "\n")


def truncate_logs(out_dir: str, last_step: int) -> None:
    """On resume: drop log records of steps after the checkpoint (they are redone)."""
    for name in STEP_LOGS:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as fh:
            keep = [line for line in fh if line.strip() and json.loads(line)["step"] <= last_step]
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(keep)
        os.replace(tmp, path)


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)

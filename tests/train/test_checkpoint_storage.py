"""Bounded storage: checkpoint rotation with pins, disk accounting, and a disk that fills
up during a checkpoint (a real tmpfs, a real Megatron engine) leaving the previous
checkpoint loadable."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from realscale.train.checkpoint import (LATEST, PIN_FILE, checkpoint_name, disk_usage, latest_checkpoint,
                                        rotate_checkpoints)


def _fake_run(root: Path, steps: list[int], latest: int) -> None:
    for s in steps:
        d = root / "checkpoints" / checkpoint_name(s)
        d.mkdir(parents=True)
        (d / "data").write_bytes(b"x" * 1000)
    (root / LATEST).write_text(str(root / "checkpoints" / checkpoint_name(latest)))


def _left(root: Path) -> list[str]:
    return sorted(os.listdir(root / "checkpoints"))


def test_rotation_keeps_the_newest_k_and_the_pinned(tmp_path: Path) -> None:
    _fake_run(tmp_path, [2, 4, 6, 8, 10], latest=10)
    (tmp_path / "checkpoints" / checkpoint_name(4) / PIN_FILE).touch()
    deleted = rotate_checkpoints(str(tmp_path), keep=2, pinned=[2])
    assert [os.path.basename(d) for d in deleted] == ["step000006"]
    assert _left(tmp_path) == ["step000002", "step000004", "step000008", "step000010"]
    assert rotate_checkpoints(str(tmp_path), keep=0) == []  # 0: keep everything


def test_rotation_never_deletes_the_latest(tmp_path: Path) -> None:
    """The pointer names an older checkpoint (a newer directory is there but not complete)."""
    _fake_run(tmp_path, [1, 2, 3], latest=1)
    rotate_checkpoints(str(tmp_path), keep=1)
    assert _left(tmp_path) == ["step000001", "step000003"]
    assert latest_checkpoint(str(tmp_path)).endswith("step000001")


def test_disk_usage_counts_checkpoints_and_weights(tmp_path: Path) -> None:
    _fake_run(tmp_path, [1, 2], latest=2)
    (tmp_path / "weights" / "v3").mkdir(parents=True)
    (tmp_path / "weights" / "v3" / "model.safetensors").write_bytes(b"w" * 500)
    use = disk_usage(str(tmp_path))
    assert use["disk/checkpoints_bytes"] == 2000 and use["disk/weights_bytes"] == 500
    assert use["disk/run_bytes"] == 2500 + len((tmp_path / LATEST).read_text())
    assert use["disk/free_bytes"] > 0


# ----------------------------------------------------------------------------- a full disk


def _fill_then_fail(root: str) -> dict:
    """One rank: checkpoint step 1 (fits), train on, checkpoint step 2 (does not fit), then
    load the surviving checkpoint and compare its weights with step 1's."""
    import torch

    from realscale.models.tiny import resolve_model_path
    from realscale.sft import nll_loss
    from realscale.train.batch import PackedBatch
    from realscale.train.checkpoint import CheckpointError, save_checkpoint
    from realscale.train.engine import EngineConfig, MegatronEngine

    eng = MegatronEngine(EngineConfig(model_path=resolve_model_path("tiny-qwen2"), lr=1e-2))
    batch = PackedBatch.from_sequences([torch.arange(1, 40)], {"loss_mask": [torch.ones(39)]})
    eng.train_step(batch, nll_loss)
    save_checkpoint(eng, root, 1, {"step": 1}, True)
    saved = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    eng.train_step(batch, nll_loss)
    moved = max(float((p.detach() - saved[n]).abs().max()) for n, p in eng.model.named_parameters())
    error = ""
    try:
        save_checkpoint(eng, root, 2, {"step": 2}, True)
    except CheckpointError as exc:
        error = str(exc)
    latest = latest_checkpoint(root)
    left = sorted(os.listdir(os.path.join(root, "checkpoints")))
    extra = eng.load(latest) if latest else {}
    diff = max(float((p.detach() - saved[n]).abs().max()) for n, p in eng.model.named_parameters())
    return {"error": error, "latest": latest, "left": left, "extra": extra, "moved": moved, "diff": diff}


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 2.5 MiB tmpfs: one checkpoint of tiny-qwen2 (1.7 MB) fits, a second does not."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("needs root and mount(8) for a small tmpfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.multiproc
def test_full_disk_during_a_checkpoint_keeps_the_previous_one(small_tmpfs: Path) -> None:
    from realscale.parallel.spawn import run_distributed

    got = run_distributed(_fill_then_fail, 1, str(small_tmpfs), timeout=300)[0]
    assert "checkpoint of step 2: No space left on device" in got["error"]
    assert "step000001" in got["error"] and "is intact" in got["error"]
    assert got["latest"] == str(small_tmpfs / "checkpoints" / "step000001")
    assert got["left"] == ["step000001"]  # the partial step000002.tmp was removed
    assert got["extra"] == {"step": 1}
    assert got["moved"] > 0 and got["diff"] == 0.0  # the loaded weights are exactly step 1's
    assert not os.path.exists(str(small_tmpfs / LATEST) + ".tmp")


# ----------------------------------------------------------------------------- the writer's set-up


def _save_twice(root: str) -> dict:
    """One rank saves twice; which result queue did megatron's saver use, and did any
    process of the save outlive it?"""
    import psutil
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from realscale.models.tiny import resolve_model_path
    from realscale.sft import nll_loss
    from realscale.train.batch import PackedBatch
    from realscale.train.checkpoint import Checkpointer, InProcessResultsQueue
    from realscale.train.engine import EngineConfig, MegatronEngine

    before = filesystem_async._results_queue
    eng = MegatronEngine(EngineConfig(model_path=resolve_model_path("tiny-qwen2"), lr=1e-2))
    ckpts = Checkpointer(root, keep=1)
    batch = PackedBatch.from_sequences([torch.arange(1, 40)], {"loss_mask": [torch.ones(39)]})
    queues, children = [], []
    for step in (1, 2):
        eng.train_step(batch, nll_loss)
        ckpts.save(eng, step, {"step": step})
        queues.append(filesystem_async._results_queue)
        children.append([c.pid for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE])
    return {"before": before is None, "in_process": [isinstance(q, InProcessResultsQueue) for q in queues],
            "same": queues[0] is queues[1], "empty": queues[1].empty(), "children": children,
            "latest": latest_checkpoint(root), "left": sorted(os.listdir(os.path.join(root, "checkpoints")))}


@pytest.mark.multiproc
def test_saves_collect_the_writers_results_in_the_rank_without_a_manager_process(tmp_path: Path) -> None:
    """megatron-core 0.16.1's ``torch_dist`` saver makes its result queue on a process's first
    save in a spawned manager process (``dist_checkpointing/strategies/filesystem_async.py``
    51-56, reached from ``FileSystemWriterAsync.prepare_write_data`` 185), which imports
    torch to unpickle the results put at 335 and outlives a SIGKILLed rank. A synchronous save
    (``strategies/base.py`` 215) puts and takes the results in the rank itself, so ours use
    an in-process queue: every save through the same one, emptied by megatron's finalize
    (439), the checkpoint complete, and no process left behind. Fails if megatron renames
    ``_results_queue`` (the saver would make its manager again) or leaves a result unread."""
    from realscale.parallel.spawn import run_distributed

    got = run_distributed(_save_twice, 1, str(tmp_path), timeout=300)[0]
    assert got["before"]  # megatron had made none before the first save
    assert got["in_process"] == [True, True] and got["same"] and got["empty"]
    assert got["children"] == [[], []], got["children"]  # the writer's forked workers are gone, no manager
    assert got["latest"] == str(tmp_path / "checkpoints" / "step000002") and got["left"] == ["step000002"]


def test_the_in_process_results_queue_refuses_another_process() -> None:
    """Should a save ever hand the queue to another process (megatron's asynchronous save runs
    its writer in a forked one), using it there raises, and it cannot be pickled for a
    spawned one: a lost result would otherwise only show as an incomplete checkpoint."""
    import multiprocessing as mp
    import pickle

    from realscale.train.checkpoint import InProcessResultsQueue

    q = InProcessResultsQueue()
    q.put({0: []})
    assert q.get_nowait() == {0: []}
    with pytest.raises(TypeError, match="cannot be sent to another process"):
        pickle.dumps(q)
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()

    def child() -> None:
        try:
            q.put({0: []})
            errors.put("")
        except RuntimeError as exc:
            errors.put(str(exc))

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(30)
    assert "realscale's saves are synchronous" in errors.get()
    assert q.empty()

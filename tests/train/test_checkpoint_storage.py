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


def _warm_then_save(root: str) -> dict:
    """One rank: warm the checkpoint writer up (as the trainer does while its first batch
    generates), then save twice; which result queue did megatron's saver use?"""
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from realscale.models.tiny import resolve_model_path
    from realscale.sft import nll_loss
    from realscale.train.batch import PackedBatch
    from realscale.train.checkpoint import Checkpointer
    from realscale.train.engine import EngineConfig, MegatronEngine

    before = filesystem_async._results_queue
    eng = MegatronEngine(EngineConfig(model_path=resolve_model_path("tiny-qwen2"), lr=1e-2))
    ckpts = Checkpointer(root, keep=1)
    ckpts.warm_up()
    ckpts._warming.join()
    warmed = filesystem_async._results_queue
    batch = PackedBatch.from_sequences([torch.arange(1, 40)], {"loss_mask": [torch.ones(39)]})
    used = []
    for step in (1, 2):
        eng.train_step(batch, nll_loss)
        ckpts.save(eng, step, {"step": step})
        used.append(filesystem_async._results_queue is warmed)
    return {"before": before is None, "warmed": warmed is not None, "used": used,
            "latest": latest_checkpoint(root), "left": sorted(os.listdir(os.path.join(root, "checkpoints")))}


@pytest.mark.multiproc
def test_the_writer_warmed_up_before_the_loop_is_the_one_every_save_uses(tmp_path: Path) -> None:
    """The first save of a process used to start megatron's writer queue (a spawned manager
    process, megatron-core 0.16.1 ``dist_checkpointing/strategies/filesystem_async.py``
    51-56, reached from ``FileSystemWriterAsync.prepare_write_data`` 185) and make it
    import torch (the first results it unpickles, put at 335) inside the loop; the trainer
    now does both beforehand (``Checkpointer.warm_up``). Fails if megatron renames that
    function or stops reusing one queue per process, or if the warm-up's ``WriteResult``
    no longer pickles."""
    from realscale.parallel.spawn import run_distributed

    got = run_distributed(_warm_then_save, 1, str(tmp_path), timeout=300)[0]
    assert got["before"] and got["warmed"]  # none until the warm-up made it
    assert got["used"] == [True, True]  # both saves wrote through the warmed-up queue
    assert got["latest"] == str(tmp_path / "checkpoints" / "step000002") and got["left"] == ["step000002"]


_KILLED_RANK = """
import os, signal, sys, threading
import realscale.train.checkpoint as ck
t = threading.Thread(target=ck.start_writer_queue)  # as Checkpointer.warm_up: on a thread that ends
t.start(); t.join()
import psutil
print(",".join(str(c.pid) for c in psutil.Process().children()), flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_writers_manager_process_dies_with_a_killed_rank() -> None:
    """megatron's writer queue lives in a spawned manager process that nothing stops when
    its rank is SIGKILLed (megatron-core 0.16.1 filesystem_async.py 51-56); the one
    start_writer_queue makes exits with its rank, though a thread started it (the
    kernel's parent-death signal would have killed it when that thread ended)."""
    import sys
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().strip().split(",") if p]
        assert pids, "start_writer_queue started no manager process"
        time.sleep(1.5)  # past the creating thread's end and one watch period: still there
        assert all(psutil.pid_exists(p) for p in pids)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == -9
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            assert time.monotonic() < deadline, f"manager process(es) {pids} outlived the killed rank"
            time.sleep(0.2)
    finally:
        proc.kill()

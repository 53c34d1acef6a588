"""Run checkpoints: where they live, how the latest one is found, and the run logs they
must agree with.

Layout of a run directory::

    checkpoints/step000010/     engine.save(): model + optimizer shards, extra state
    checkpoints/step000010/critic/   the value model's, the same way (PPO with GAE)
    latest_checkpoint           the path of the newest *complete* checkpoint
    final/                      the HF export at the end of training (export.json: its step)
    metrics.jsonl               one record per step
    trained_uids.jsonl          which prompts each step trained on

A checkpoint is complete before the pointer moves (atomic rename), so a crash while
saving leaves the previous checkpoint as the one a restart resumes from. On resume the
logs are cut back to the checkpoint's step, so every step appears once in them.

Bounded storage: after each successful save, :func:`rotate_checkpoints` deletes all but
the newest ``run.keep_checkpoints`` checkpoints, never one that is pinned
(``run.pin_checkpoints``, or a ``PIN`` file inside its directory) and never the one
``latest_checkpoint`` names. A save that fails for want of space (ENOSPC, EDQUOT) removes
its partial directory and raises :class:`CheckpointError`; the pointer still names the
previous checkpoint, which stays loadable. :func:`disk_usage` measures the run directory
for the metrics and the summary.

The end-of-run export (:func:`export_final`) is made by the trainer ranks themselves
after the last step, on their own devices and backend (NCCL gathers on GPUs), every rank
taking part in the gathers, not by a separate job; it is written under a temporary name
and renamed whole, with ``export.json`` saying which step it holds and which ranks made
it. The supervisor evaluates it only if that record names the run's last step
(:func:`read_final_export`).
"""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from realscale.train.engine import MegatronEngine

LATEST = "latest_checkpoint"
FINAL = "final"
EXPORTS = "exports"
FINAL_RECORD = "export.json"
PIN_FILE = "PIN"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one is intact."""
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
                    is_driver: bool, critic: "MegatronEngine | None" = None) -> str:
    """Save model, optimizer and ``extra`` (rank 0's, sent to every rank) after ``step``
    (and the critic's, when there is one); move the pointer once the checkpoint is
    complete. Every trainer rank calls it."""
    import torch.distributed as dist

    ckpt = os.path.join(out_dir, "checkpoints", checkpoint_name(step))
    holder = [extra]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    try:
        engine.save(ckpt, extra=holder[0])
        if critic is not None:
            critic.save(critic_dir(ckpt))
        if is_driver:
            _atomic_write(os.path.join(out_dir, LATEST), ckpt)
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # Whatever broke the save, the partial directory is garbage holding the space the
        # next attempt needs.
        shutil.rmtree(ckpt.rstrip("/") + ".tmp", ignore_errors=True)
        _remove_quietly(os.path.join(out_dir, LATEST) + ".tmp")
        previous = latest_checkpoint(out_dir)
        raise CheckpointError(f"checkpoint of step {step}: {_failure_reason(exc, out_dir, previous)} "
                              f"({_free_text(out_dir)} on {out_dir}); the previous checkpoint "
                              f"{previous or '(none)'} is intact: run again to resume from it") from exc
    return ckpt


class InProcessResultsQueue(queue.Queue):
    """megatron's checkpoint writer's result queue for synchronous saves: a plain
    thread queue, refusing use from any process but the one that made it.

    megatron-core's ``torch_dist`` saver (``dist_checkpointing/strategies/filesystem_async.py``
    in 0.16.1) collects its writer's results through a queue it makes on the first save of a
    process (51-56, ``_get_write_results_queue``: a ``multiprocessing.Manager().Queue()``, so
    a *spawned* manager process that lives as long as the rank and imports torch to unpickle
    the first results it is sent). That is for megatron's asynchronous save, whose
    ``write_preloaded_data_multiproc`` runs in a forked process. Our saves are synchronous
    (``dist_checkpointing.save`` runs the request in the rank, ``strategies/base.py`` 215
    ``execute_sync``): the rank itself puts the results (``filesystem_async.py`` 335, after
    its own forked writers reported through their local queue) and takes them back in
    ``retrieve_write_results`` (439, ``get_nowait``), so the queue never leaves the process.
    The manager cost a process (~330 MB resident, outliving a SIGKILLed rank) and ~4
    CPU-seconds at start-up on the 2-core default recipe, where every CPU-second is on the
    path to the first step. Should a save ever run that function in another process (an
    asynchronous save), ``put`` there raises, and megatron's finalize reports the queue
    empty: loud, never a result lost in silence."""

    def __init__(self) -> None:
        super().__init__()
        self.pid = os.getpid()

    def _check(self) -> None:
        if os.getpid() != self.pid:
            raise RuntimeError(f"checkpoint writer's result queue of process {self.pid} used in process "
                               f"{os.getpid()}: realscale's saves are synchronous (an asynchronous save needs "
                               f"megatron's own manager queue)")

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self._check()
        super().put(item, block, timeout)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        self._check()
        return super().get(block, timeout)

    def __reduce__(self) -> Any:
        raise TypeError("the checkpoint writer's in-process result queue cannot be sent to another process")


def use_in_process_writer_queue() -> InProcessResultsQueue:
    """Give megatron's ``torch_dist`` saver an :class:`InProcessResultsQueue` (where it keeps
    its own, ``filesystem_async._results_queue``, a private name of the pinned megatron-core:
    ``tests/train/test_checkpoint_storage.py`` fails if it moves) unless this process already
    has one; every save of the process uses it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    current = filesystem_async._results_queue
    if isinstance(current, InProcessResultsQueue) and current.pid == os.getpid():
        return current
    filesystem_async._results_queue = InProcessResultsQueue()
    return filesystem_async._results_queue


def critic_dir(ckpt_dir: str) -> str:
    """Where a run checkpoint keeps the critic's state."""
    return os.path.join(ckpt_dir, "critic")


def _failure_reason(exc: BaseException, out_dir: str, previous: str | None) -> str:
    """"No space left on device" when the disk is the cause: said so by the error, or too
    little space is left for another checkpoint the size of the previous one (megatron's
    writer sometimes reports a full disk only as a torch zip-writer failure)."""
    short = previous is not None and shutil.disk_usage(out_dir).free < _tree_bytes(previous)
    if _no_space(exc) or short:
        return os.strerror(errno.ENOSPC)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is a full disk or an exhausted quota. Megatron's
    checkpoint writer reports a worker's ENOSPC only as text inside its own exception."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE:
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    return any(f"[Errno {code}]" in text or os.strerror(code) in text for code in _NO_SPACE)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _free_text(path: str) -> str:
    free = shutil.disk_usage(path).free
    return f"{free / 2**20:.1f} MiB free"


def _step_of(name: str) -> int | None:
    if name.startswith("step") and name[4:].isdigit():
        return int(name[4:])
    return None


def rotate_checkpoints(out_dir: str, keep: int, pinned: Iterable[int] = ()) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints (0: keep all); pinned steps,
    directories with a ``PIN`` file, and the latest checkpoint stay. Returns what was deleted."""
    root = os.path.join(out_dir, "checkpoints")
    if keep <= 0 or not os.path.isdir(root):
        return []
    steps = sorted(s for s in map(_step_of, os.listdir(root)) if s is not None)
    latest = latest_checkpoint(out_dir)
    pins = set(pinned)
    deleted = []
    for step in steps[:-keep]:
        path = os.path.join(root, checkpoint_name(step))
        if step in pins or os.path.exists(os.path.join(path, PIN_FILE)) or path == latest:
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass  # deleted while we walked (rotation, weight pruning)
    return total


def disk_usage(out_dir: str) -> dict[str, float]:
    """Bytes the run directory holds (all of it, its checkpoints, its disk weight
    versions) and the bytes still free on its file system."""

    return {"disk/run_bytes": float(_tree_bytes(out_dir)),
            "disk/checkpoints_bytes": float(_tree_bytes(os.path.join(out_dir, "checkpoints"))),
            "disk/weights_bytes": float(_tree_bytes(os.path.join(out_dir, "weights"))),
            "disk/free_bytes": float(shutil.disk_usage(out_dir).free)}


def record_trained(out_dir: str, step: int, uids: list[str]) -> None:
    """Which prompts (sample uids) ``step`` trained on (audits resume: nothing repeated or skipped)."""
    with open(os.path.join(out_dir, "trained_uids.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, "uids": list(uids)}) + "\n")


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


def final_dir(out_dir: str) -> str:
    """Where the run's end-of-training HF export goes."""
    return os.path.join(out_dir, FINAL)


def export_dir(out_dir: str, step: int) -> str:
    """Where the HF snapshot of step ``step`` goes (``run.export_every``)."""
    return os.path.join(out_dir, EXPORTS, f"step_{step:06d}")


def export_final(engine: "MegatronEngine", out_dir: str, step: int, dest: str = "") -> str:
    """Write the trained weights as an HF directory, ``<run>/final`` (or ``dest``: a
    snapshot, :func:`export_dir`): a collective of every trainer rank (the tensor- and
    pipeline-parallel gathers run on the ranks' own backend and devices); rank 0 writes,
    into ``<dest>.tmp`` renamed whole, with ``export.json`` (the step, the world and
    backend that made it, the layout). Returns the directory."""
    import torch.distributed as dist  # (torch: this module has none at the top)

    final = dest or final_dir(out_dir)
    tmp = final + ".tmp"
    driver = dist.get_rank() == 0
    if driver:
        shutil.rmtree(tmp, ignore_errors=True)  # an export cut short earlier
    engine.save_hf(tmp)
    if driver:
        record = {"step": step, "world_size": dist.get_world_size(), "backend": str(dist.get_backend()),
                  "layout": {"tp": engine.ec.tp, "pp": engine.ec.pp, "dp": engine.ranks.dp}}
        _atomic_write(os.path.join(tmp, FINAL_RECORD), json.dumps(record, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    return final


def read_final_export(out_dir: str) -> dict[str, Any] | None:
    """The record of the run's end-of-training export, or None when there is none."""
    try:
        with open(os.path.join(final_dir(out_dir), FINAL_RECORD), encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


class Checkpointer:
    """A run's checkpoints, owned in one place: the newest complete one (:meth:`latest`),
    resuming from it (:meth:`load`), saving after a step and then bounding storage
    (:meth:`save`, :meth:`rotate`). Every trainer rank holds one; only the driver moves
    the pointer and deletes old checkpoints."""

    def __init__(self, out_dir: str, keep: int = 0, pinned: Iterable[int] = (), is_driver: bool = True) -> None:
        self.out_dir = out_dir
        self.keep = keep
        self.pinned = tuple(pinned)
        self.is_driver = is_driver

    def latest(self) -> str | None:
        return latest_checkpoint(self.out_dir)

    def load(self, engine: "MegatronEngine", critic: "MegatronEngine | None" = None) -> tuple[str | None, dict[str, Any]]:
        """Restore ``engine`` (and ``critic``) from the newest checkpoint; (its path, the
        extra state saved with it), or (None, {}) for a fresh run."""
        ckpt = self.latest()
        if ckpt is None:
            return None, {}
        extra = engine.load(ckpt)
        if critic is not None:
            critic.load(critic_dir(ckpt))
        return ckpt, extra

    def save(self, engine: "MegatronEngine", step: int, extra: dict[str, Any],
             critic: "MegatronEngine | None" = None) -> str:
        """Checkpoint after ``step`` (every rank), then rotate (the driver: the new one is
        complete, older ones may go)."""
        ckpt = save_checkpoint(engine, self.out_dir, step, extra, self.is_driver, critic=critic)
        if self.is_driver:
            self.rotate()
        return ckpt

    def rotate(self) -> list[str]:
        return rotate_checkpoints(self.out_dir, self.keep, self.pinned)


"""Per-rank figures of a step, gathered to the driver: does one rank hold the others up?

Trainer ranks run in lockstep (every collective waits for the slowest), so a step's wall
time is the same on all of them and cannot say which rank is slow. The time each rank
spends computing can: :class:`ComputeClock` hangs megatron's own timers
(:class:`megatron.core.timers.Timers`) on the engine's model config, and the pipeline
schedule then times every micro-batch's ``forward-compute`` and ``backward-compute``.
Those exclude the data-parallel gradient reduction and the pipeline's sends and receives
(waits for other ranks); a TP group's per-layer collectives are inside them (TP peers
wait for each other there). On GPUs megatron's timers synchronise the device at each
start and stop (one sync per micro-batch forward and backward; not measured here: no GPU).

:func:`gather_figures` all-gathers a few floats per rank once per step (one small
collective); :func:`step_figures` turns them into the step's metrics:

- ``perf/compute_s_rank0`` / ``perf/compute_s_max_other``: forward/backward compute seconds
  of rank 0 and of the slowest other rank (rank 0 also hosts the rollout side);
- ``perf/train_cpu_s`` / ``perf/train_runq_s`` (driver rank, :class:`CpuClock`): CPU seconds its
  process spent in the update and seconds the thread running the update sat runnable on a
  run queue waiting for a core (Linux; absent elsewhere). Wall time minus these two is time blocked (I/O,
  locks, collectives). On a CPU host the run queue says whether the update was starved by
  the generation server, the rollout process or another job;
- ``perf/batch_bytes`` (sum over ranks of the tensor bytes received),
  ``perf/batch_header_bytes``, ``perf/batch_s`` (the slowest rank's transfer time) from
  :class:`realscale.train.batch_scatter.ScatterStats`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from realscale.parallel.device import comm_empty, to_comm

COMPUTE_TIMERS = ("forward-compute", "backward-compute")


class ComputeClock:
    """Forward/backward compute seconds of this rank, from megatron's schedule timers, over
    every model it runs (the actor; the critic and the reference when present: one clock on
all their configs)."""

    def __init__(self, *model_configs: Any) -> None:
        from megatron.core.timers import Timers

        self.timers = Timers(log_level=2, log_option="max")
        for config in model_configs:
            config.timers = self.timers
            # the schedule's whole-step timer would otherwise start with a global barrier
            config.barrier_with_L1_time = False

    def seconds(self) -> float:
        """Compute seconds since the previous call."""
        return sum(self.timers(name).elapsed(reset=True) for name in COMPUTE_TIMERS)


def _runq_seconds() -> float | None:
    """Seconds the calling thread has waited on a run queue (runnable, no core free):
    field 2 of ``/proc/self/task/TID/schedstat`` (Linux); None where there is none. The
    calling thread only: with one torch thread it runs every op of the update, while the
    process's other threads (gloo's loops, the server-control loop) mostly sleep."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat", encoding="ascii") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class CpuClock:
    """This process's CPU seconds and the calling thread's run-queue waiting seconds
    between two calls."""

    def __init__(self) -> None:
        self._cpu, self._runq = time.process_time(), _runq_seconds()

    def seconds(self) -> dict[str, float]:
        """``{"cpu_s": ..., "runq_s": ...}`` since the previous call (``runq_s`` only on Linux)."""
        cpu, runq = time.process_time(), _runq_seconds()
        out = {"cpu_s": cpu - self._cpu}
        if runq is not None and self._runq is not None:
            out["runq_s"] = max(0.0, runq - self._runq)
        self._cpu, self._runq = cpu, runq
        return out


def gather_figures(local: dict[str, float]) -> list[dict[str, float]]:
    """Every rank's ``local`` figures (same keys on every rank), in rank order."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [dict(local)]
    keys = sorted(local)
    backend = dist.get_backend()
    mine = to_comm(torch.tensor([local[k] for k in keys], dtype=torch.float64), backend)
    out = [comm_empty(mine.shape, mine.dtype, backend) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [dict(zip(keys, t.cpu().tolist())) for t in out]


def step_figures(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The step's metrics from every rank's figures (module docstring)."""
    out = {"perf/batch_bytes": sum(r["batch_bytes"] for r in per_rank),
           "perf/batch_header_bytes": sum(r["batch_header_bytes"] for r in per_rank),
           "perf/batch_s": max(r["batch_s"] for r in per_rank),
           "perf/compute_s_rank0": per_rank[0]["compute_s"]}
    if len(per_rank) > 1:
        out["perf/compute_s_max_other"] = max(r["compute_s"] for r in per_rank[1:])
    return out

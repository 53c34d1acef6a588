"""Several rollout processes under one staleness rule: the rollout side scaled out.

One rollout process (HTTP client, workflow, reward dispatch, packing: a
:class:`~realscale.rollout.process.ControllerProcess`) ingests a bounded number of
generated tokens per second, one core's worth of Python (BENCHMARKS.md, "The rollout
tier": ``benchmarks/bench_rollout_tier.py``). Past that, :class:`ShardedRollouts` runs
``k`` of them, each a *shard*:

- shard ``i`` owns the servers ``i, i + k, ...`` (:func:`shard_servers`) and the prompts
  of data-parallel rank ``i`` of ``k`` (``build_controller(..., rank=i, world=k)``), so no
  prompt is drawn twice and no server is shared;
- the staleness rule is split exactly (:func:`shard_config`): shard ``i`` takes ``B_i``
  of the step's ``B`` groups and may run ``max_concurrent_i`` prompts at once, with
  ``sum B_i = B``; every shard is moved to every version together. So the counts the rule
  bounds, summed over the shards, are one controller's: at most ``(η + v + 1)·B`` groups
  accepted or running, every trained group at most η versions old (each shard waits for
  its own due groups), ``max_concurrent`` prompts running;
- :meth:`ShardedRollouts.next_batch` asks every shard for its share at once (their
  packing into arrays runs in parallel, in their processes; each share becomes tensors
  in this process as it arrives) and joins the packed batches in shard order; ``stats``
  sums the counters.

How it departs from one controller: admission is per shard, so a shard whose servers are
slower cannot borrow the others' room, and a batch waits for the slowest shard's share
(with hundreds of groups per shard and alike servers, the spread is small). A restarted
server (``admit``) joins the shard with the fewest servers not retired; a shard whose
servers all died gets no share done until one joins it (trainer rank 0 republishes the
weights to restarted servers then: :mod:`realscale.publish.outage`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from realscale.rollout.factory import resolved_data_config
from realscale.rollout.process import ControllerProcess, RolloutBatch
from realscale.train.batch import PackedBatch

if TYPE_CHECKING:
    from realscale.config import Config


class Shard(Protocol):
    """What ShardedRollouts asks of one rollout process (ControllerProcess, LocalRollouts)."""

    def next_batch(self, num_groups: int, version: int, timeout: float | None = None, poll_s: float | None = None,
                   waited_s: float = 0.0) -> RolloutBatch | None: ...

    def rotation(self) -> list[list[str]]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def set_version(self, version: int) -> None: ...

    def retire(self, urls: list[str]) -> None: ...

    def admit(self, urls: list[str]) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def reward_pool_stats(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def stop(self) -> None: ...


# ---------------------------------------------------------------------- splitting


def split_evenly(total: int, k: int) -> list[int]:
    """``total`` as ``k`` near-equal parts, larger first (sum: ``total``)."""
    if k < 1:
        raise ValueError(f"rollout shards: need k >= 1, got {k}")
    return [total // k + (1 if i < total % k else 0) for i in range(k)]


def shard_servers(urls: Sequence[str], k: int) -> list[list[str]]:
    """Server ``j`` to shard ``j mod k``; every shard needs at least one."""
    if len(urls) < k:
        raise ValueError(f"rollout shards: {k} shards need at least {k} servers, got {len(urls)}")
    return [list(urls[i::k]) for i in range(k)]


def shard_config(cfg: "Config", k: int, i: int) -> "Config":
    """``cfg`` for shard ``i`` of ``k``: its share of ``rollout.batch_size`` and of
    ``rollout.max_concurrent`` (and of ``rollout.max_ahead``, when set)."""
    r = cfg.rollout
    batch = split_evenly(r.batch_size, k)[i]
    if batch < 1:
        raise ValueError(f"rollout shards: rollout.batch_size={r.batch_size} cannot give each of {k} shards a group")
    ahead = max(batch, split_evenly(r.max_ahead, k)[i]) if r.max_ahead else 0
    rollout = dataclasses.replace(r, batch_size=batch, max_concurrent=max(1, split_evenly(r.max_concurrent, k)[i]),
                                  max_ahead=ahead, processes=1)  # a shard is one rollout process
    return dataclasses.replace(cfg, rollout=rollout)


# ---------------------------------------------------------------------- joining


def join_batches(parts: Sequence[RolloutBatch]) -> RolloutBatch:
    """Packed batches back to back (sequence order: shard by shard), their statistics
    combined: sums for counts, maxima for maxima, means weighted by what they average."""
    if len(parts) == 1:
        return parts[0]
    batches = [p.batch for p in parts]
    offsets = torch.tensor([0] + [b.num_tokens for b in batches[:-1]]).cumsum(0)
    cu = torch.cat([batches[0].cu_seqlens] + [b.cu_seqlens[1:] + off for b, off in zip(batches[1:], offsets[1:])])
    fields = {k: torch.cat([b.fields[k] for b in batches]) for k in batches[0].fields}
    joined = PackedBatch(torch.cat([b.input_ids for b in batches]), cu, fields)
    return RolloutBatch(joined, join_stats([p.stats for p in parts]), [u for p in parts for u in p.uids])


_SUMS = ("rollout/groups", "rollout/trajectories", "rollout/interruptions", "perf/trained_tokens")
_BY_GROUP = ("staleness/mean",)


def join_stats(stats: Sequence[dict[str, float]]) -> dict[str, float]:
    """One batch's statistics from its shards' (see :func:`join_batches`)."""
    out: dict[str, float] = {}
    for key in stats[0]:
        values = [s.get(key, 0.0) for s in stats]
        if key in _SUMS:
            out[key] = float(sum(values))
        elif key.endswith("_max") or key.endswith("/max"):
            out[key] = float(max(values))
        else:  # a mean: over groups for staleness, over trajectories for the rest
            w = [s.get("rollout/groups" if key in _BY_GROUP else "rollout/trajectories", 1.0) for s in stats]
            out[key] = float(sum(v * x for v, x in zip(values, w)) / max(sum(w), 1e-12))
    return out


_COUNTERS = ("submitted", "accepted", "rejected", "failures", "running", "buffer", "consumed", "requeued",
             "capacity", "due_waits", "generated_tokens", "inflight", "servers_in_rotation")


def join_controller_stats(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The shards' controller counters as one controller's (sums; the busiest server's
    count as a maximum; the shards themselves under ``shards``)."""
    out: dict[str, Any] = {k: sum(s.get(k, 0) for s in stats) for k in _COUNTERS if any(k in s for s in stats)}
    for key in ("rejected_by_reason", "failures_by_type", "staleness_hist", "submitted_by_version"):
        merged: dict[Any, int] = {}
        for s in stats:
            for k, v in s.get(key, {}).items():
                merged[k] = merged.get(k, 0) + v
        out[key] = dict(sorted(merged.items()))
    out["paused"] = any(s.get("paused", False) for s in stats)
    out["exhausted"] = all(s.get("exhausted", False) for s in stats)
    out["inflight_server_max"] = max((s.get("inflight_server_max", 0) for s in stats), default=0)
    out["version"] = min(s.get("version", 0) for s in stats)
    out["shards"] = list(stats)
    return out


# ---------------------------------------------------------------------- the rollouts


class ShardedRollouts:
    """The rollout interface (:data:`realscale.rollout.process.Rollouts`) over ``k`` shards
    (module docstring). ``servers[i]``: the server URLs shard ``i`` owns."""

    def __init__(self, shards: Sequence[Shard], servers: Sequence[Sequence[str]], batch_size: int) -> None:
        if not shards or len(shards) != len(servers):
            raise ValueError(f"rollout shards: {len(shards)} shards for {len(servers)} server lists")
        self.shards = list(shards)
        self.servers = [[u.rstrip("/") for u in s] for s in servers]
        self.shares = split_evenly(batch_size, len(shards))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="shard")
        self._ready: dict[int, RolloutBatch] = {}  # shares taken by a next_batch that another shard failed
        self._retired: set[str] = set()  # servers a weight update retired

    def _each(self, fn: Any) -> list[Any]:
        """``fn(shard, i)`` on every shard at once; the first error is raised."""
        futures = [self._pool.submit(fn, s, i) for i, s in enumerate(self.shards)]
        return [f.result() for f in futures]

    def next_batch(self, num_groups: int, version: int, timeout: float | None = None, poll_s: float | None = None,
                   waited_s: float = 0.0) -> RolloutBatch | None:
        """Every shard's share, joined. A shard that runs out of time raises its error (with
        ``poll_s``, one without its share yet makes it None); the shares the others
        already took are kept for the next call (they left their buffers)."""
        if num_groups != sum(self.shares):
            raise ValueError(f"rollout shards: a batch is {sum(self.shares)} groups (the shards' shares "
                             f"{self.shares}), asked for {num_groups}")
        todo = [i for i in range(len(self.shards)) if i not in self._ready]
        futures = {i: self._pool.submit(self.shards[i].next_batch, self.shares[i], version, timeout, poll_s, waited_s)
                   for i in todo}
        error: BaseException | None = None
        for i, fut in futures.items():
            try:
                part = fut.result()
            except Exception as exc:  # noqa: BLE001 - raised below, after the others' shares are kept
                error = error or exc
                continue
            if part is not None:
                self._ready[i] = part
        if error is not None:
            raise error
        if len(self._ready) < len(self.shards):
            return None
        parts, self._ready = [self._ready[i] for i in range(len(self.shards))], {}
        return join_batches(parts)

    def rotation(self) -> list[list[str]]:
        """Per shard, the servers in rotation (a shard with none makes no share of a batch)."""
        return [urls for per in self._each(lambda s, i: s.rotation()) for urls in per]

    def pause(self) -> None:
        self._each(lambda s, i: s.pause())

    def resume(self) -> None:
        self._each(lambda s, i: s.resume())

    def set_version(self, version: int) -> None:
        self._each(lambda s, i: s.set_version(version))

    def retire(self, urls: list[str]) -> None:
        mine = self._by_shard(urls)
        self._retired.update(u for per in mine for u in per)
        self._each(lambda s, i: s.retire(mine[i]) if mine[i] else None)

    def admit(self, urls: list[str]) -> None:
        """Servers (restarted, holding this version) join: each one the shard that owns it,
        a new one the shard with the fewest servers not retired (one whose servers all
        died gets it first)."""
        mine: list[list[str]] = [[] for _ in self.shards]
        for url in (u.rstrip("/") for u in urls):
            owner = self._owner(url)
            if owner is None:
                owner = min(range(len(self.shards)), key=lambda i: len(set(self.servers[i]) - self._retired))
                self.servers[owner].append(url)
            self._retired.discard(url)
            mine[owner].append(url)
        self._each(lambda s, i: s.admit(mine[i]) if mine[i] else None)

    def _owner(self, url: str) -> int | None:
        return next((i for i, s in enumerate(self.servers) if url in s), None)

    def _by_shard(self, urls: list[str]) -> list[list[str]]:
        mine: list[list[str]] = [[] for _ in self.shards]
        for url in (u.rstrip("/") for u in urls):
            owner = self._owner(url)
            if owner is None:
                raise ValueError(f"rollout shards: {url} is not a server of any shard")
            mine[owner].append(url)
        return mine

    def stats(self) -> dict[str, Any]:
        return join_controller_stats(self._each(lambda s, i: s.stats()))

    def reward_pool_stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for st in self._each(lambda s, i: s.reward_pool_stats()):
            for k, v in st.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def state_dict(self) -> dict[str, Any]:
        """Every shard's state, in shard order (a resumed run needs as many shards)."""
        return {"shards": self._each(lambda s, i: s.state_dict())}

    def stop(self) -> None:
        try:
            self._each(lambda s, i: s.stop())
        finally:
            self._pool.shutdown(wait=True)


def start_sharded(cfg: "Config", model_dir: str, server_urls: list[str], out_dir: str,
                  state: dict[str, Any] | None = None, *, go: bool = False) -> ShardedRollouts:
    """``rollout.processes`` rollout processes over the run's servers, started together,
    paused (or generating at once with ``go``: see :func:`start_rollouts`); a ``task:``
    data source is written out once here, not by every shard."""
    k = cfg.rollout.processes
    shards = (state or {}).get("shards") or [None] * k
    if len(shards) != k:
        raise ValueError(f"rollout.processes={k}, but the checkpoint holds the state of {len(shards)} rollout "
                         "processes: resume with the same rollout.processes")
    cfg = dataclasses.replace(cfg, data=resolved_data_config(cfg, out_dir))
    servers = shard_servers(server_urls, k)
    started: list[ControllerProcess] = []
    try:
        for i in range(k):
            started.append(ControllerProcess(shard_config(cfg, k, i), model_dir, servers[i], out_dir, shards[i],
                                             shard=(i, k), go=go))
        if not go:
            for proc in started:
                proc.ready()
    except BaseException:
        for proc in started:
            proc.stop()
        raise
    return ShardedRollouts(started, servers, cfg.rollout.batch_size)

"""Data movement in a simulated step: the weight update and the rollout batch.

Both terms are ``latency_s + bytes x seconds_per_byte`` (:class:`LinkCost`), each with a
:class:`~realscale.planner.hardware.Source` saying whether its figures were **measured**
(a benchmark's results JSON, named, with the command that wrote it) or **assumed**.

- **Weight sync**: the bytes are the resharder's plan from the training layout to the
  servers' (:func:`realscale.parallel.reshard.plan_reshard`), its busiest GPU deciding
  (sends and receives overlap). By default every GPU moves them
  at the profile's NVLink / InfiniBand bandwidth times ``eff.link``
  (``ReshardPlan.estimate_seconds``); :func:`weight_cost_from_bench` takes the resharder's
  measured cost instead, from ``benchmarks/bench_weight_sync.py``'s results (the reshard
  data path on gloo, from a barrier until the last server rank holds its shard): seconds
  against bytes per destination rank, fitted robustly (below). That figure is the CPU's
  (gloo over loopback); it describes this machine, not a GPU cluster.
  The pause / resume around the move is the profile's ``eff.weight_update_overhead_s``.
- **Batch data path**: before a step trains, the batch (token ids, loss mask, behaviour
  log-probs, advantages, versions: :data:`ASSUMED_BATCH_BYTES_PER_TOKEN` bytes per token
  unless measured) goes from the rollout controller to the trainer ranks. By default
  (:func:`assumed_batch_cost`) it leaves one host at the profile's InfiniBand bandwidth
  times ``eff.link`` (**assumed**). :func:`batch_cost_from_bench` reads
  ``benchmarks/results/bench_batch_transfer.json`` (``benchmarks/bench_batch_transfer.py``,
  the batch scatter against the pickled broadcast, 2 and 4 gloo ranks): the benchmark's
  own line for one method (``data_path_model``) or one through its rows, and the bytes
  delivered per token. Those are CPU/gloo figures; a GPU cluster's are not measured.

The fit (:func:`robust_line`): Siegel's repeated median, so measurements slowed by bursts
of load from other processes do not tilt the line (the benchmarks ran on a shared machine; their load is in their JSON).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from realscale.launcher.calibrate import robust_line as fit
from realscale.planner.hardware import Source
from realscale.sim.workload import WorkloadError

WEIGHT_SYNC_BENCH = os.path.join("benchmarks", "results", "bench_weight_sync.json")
BATCH_TRANSFER_BENCH = os.path.join("benchmarks", "results", "bench_batch_transfer.json")
# int64 token id + fp32 loss mask, behaviour log-prob, advantage and version per token
ASSUMED_BATCH_BYTES_PER_TOKEN = 8 + 4 * 4


@dataclass(frozen=True)
class LinkCost:
    """``seconds(bytes) = latency_s + bytes * seconds_per_byte``; ``source`` says where the
    two numbers come from."""

    latency_s: float
    seconds_per_byte: float
    source: Source
    bytes_per_token: float = float(ASSUMED_BATCH_BYTES_PER_TOKEN)  # batch costs: bytes one trained token moves

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.seconds_per_byte >= 0 and self.bytes_per_token > 0):
            raise WorkloadError(f"transfer cost needs latency >= 0, seconds per byte >= 0, bytes per token > 0: {self}")

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    def describe(self) -> str:
        gbps = 1 / self.seconds_per_byte / 1e9 if self.seconds_per_byte > 0 else math.inf
        return f"{self.latency_s * 1e3:.2f} ms + bytes at {gbps:.2f} GB/s ({self.source.kind}: {self.source.ref})"


def robust_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of ``y = a + b x``: :func:`realscale.launcher.calibrate.robust_line`."""

    try:
        return fit(points)
    except ValueError as exc:
        raise WorkloadError(f"transfer cost: {exc}") from None


def _load(path: str, what: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise WorkloadError(f"{what}: no results at {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{what}: {path} is not JSON ({exc})") from None


def weight_cost_from_bench(path: str = WEIGHT_SYNC_BENCH) -> LinkCost:
    """The resharder's measured data path: seconds (``ours_s``) against the bytes each
    destination rank received (``ours_bytes`` over the row's destination ranks)."""
    data = _load(path, "weight sync")
    points = []
    for row in data.get("rows", []):
        try:
            ranks = 2 if row["destination"] in ("2 x 1-rank", "1 x 2-rank") else int(row["destination_ranks"])
            points.append((float(row["ours_bytes"]) / ranks, float(row["ours_s"])))
        except (KeyError, TypeError, ValueError):
            raise WorkloadError(f"weight sync: {path}: a row lacks ours_bytes / ours_s / destination: {row}") from None
    a, b = robust_line(points)
    ref = (f"{path}: the resharder's data path on gloo, {len(points)} rows (`{data.get('command', '?').strip()}`, "
           f"{_load_avg(data)})")
    return LinkCost(a, b, Source("measured", ref))


def _load_avg(data: dict[str, Any]) -> str:
    """The load average a results file recorded (``uptime``, or ``uptime_at_start``)."""
    for key in ("uptime", "uptime_at_start", "uptime_start"):
        if key in data and "load average:" in str(data[key]):
            return "load average " + str(data[key]).split("load average:")[-1].strip()
    return "load not recorded"


def batch_cost_from_bench(path: str = BATCH_TRANSFER_BENCH, method: str = "scatter") -> LinkCost:
    """The measured batch path of ``method``: the benchmark's own fit (``data_path_model``:
    seconds = fixed_s + s_per_byte x bytes delivered to the trainer ranks) when it has one,
    else a line through its rows (seconds against bytes delivered); bytes per trained token
    from the rows (delivered bytes over tokens)."""
    data = _load(path, "batch transfer")
    rows = [r for r in data.get("rows", []) if r.get("method") == method]
    if not rows:
        raise WorkloadError(f"batch transfer: {path} has no rows of method {method!r}")
    try:
        points = [(float(r.get("bytes", r["batch_bytes"])), float(r["seconds"])) for r in rows]
        per_token = sum(x for x, _ in points) / sum(float(r["tokens"]) for r in rows)
    except (KeyError, TypeError, ValueError):
        raise WorkloadError(f"batch transfer: {path}: rows need bytes (or batch_bytes), seconds and tokens") from None
    model = data.get("data_path_model", {}).get(method)
    load = _load_avg(data)
    if model:
        a, b = float(model["fixed_s"]), float(model["s_per_byte"])
        ref = f"{path}: data_path_model[{method}] ({model.get('rows', '?')} rows, gloo, {load})"
    else:
        a, b = robust_line(points)
        ref = f"{path}: the {method} rows on gloo, a line through {len(rows)} ({load})"
    return LinkCost(a, b, Source("measured", ref), bytes_per_token=per_token)


def assumed_batch_cost(hw: Any) -> LinkCost:
    """The default batch term: the batch leaves one host at the profile's InfiniBand
    bandwidth times ``eff.link`` (assumed; no latency)."""
    spb = 1.0 / (hw.gpu.ib_gbps * 1e9 * hw.eff.link)
    return LinkCost(0.0, spb, Source("assumed", f"the batch leaves the controller's host at {hw.gpu.ib_gbps:g} GB/s "
                                                f"x link efficiency {hw.eff.link:g} (profile {hw.name})"))


def batch_cost(spec: str, hw: Any) -> LinkCost:
    """``--batch-path``: ``assumed`` (default), ``measured`` (the default results file, its
    scatter rows) or ``measured:FILE[:METHOD]``."""
    kind, _, rest = spec.partition(":")
    if kind == "assumed" and not rest:
        return assumed_batch_cost(hw)
    if kind == "measured":
        path, _, method = rest.partition(":")
        return batch_cost_from_bench(path or BATCH_TRANSFER_BENCH, method or "scatter")
    raise WorkloadError(f"--batch-path {spec}: expected assumed, measured or measured:FILE[:METHOD]")


def weight_cost(spec: str) -> LinkCost | None:
    """``--weight-sync``: ``link`` (default: the plan at link speed), ``measured`` (the
    default results file) or ``measured:FILE``."""
    kind, _, rest = spec.partition(":")
    if kind == "link" and not rest:
        return None
    if kind == "measured":
        return weight_cost_from_bench(rest or WEIGHT_SYNC_BENCH)
    raise WorkloadError(f"--weight-sync {spec}: expected link, measured or measured:FILE")

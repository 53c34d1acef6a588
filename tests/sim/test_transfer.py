"""Data-movement terms: the robust fit, the measured weight-sync and batch costs read from
benchmark results, and that the simulator's step uses them (exactly, on a tiny layout)."""

from __future__ import annotations

import json
import os

import pytest

from realscale.parallel.mesh import Layout, Mesh, Strategy
from realscale.parallel.model_spec import known_model
from realscale.parallel.reshard import plan_reshard
from realscale.planner.hardware import builtin_profile
from realscale.sim import transfer as T
from realscale.sim.build import RunLayout, sync_seconds, trainer_model
from realscale.sim.workload import WorkloadError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_robust_line_recovers_a_line_despite_one_slowed_point() -> None:
    """Repeated median: four points on 2 ms + 1 ns/byte and one 10x slower (a burst of load)."""
    pts = [(x, 2e-3 + 1e-9 * x) for x in (1e5, 1e6, 4e6, 1e7)] + [(2e7, 10 * (2e-3 + 1e-9 * 2e7))]
    a, b = T.robust_line(pts)
    assert a == pytest.approx(2e-3, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)
    with pytest.raises(WorkloadError, match="two or more sizes"):
        T.robust_line([(1.0, 1.0), (1.0, 2.0)])


def test_weight_cost_from_the_committed_resharder_benchmark() -> None:
    """bench_weight_sync.json (main's resharder in the loop): a measured line whose slope is a
    plausible loopback-gloo bandwidth (0.05-50 GB/s), labelled with the file and command."""
    cost = T.weight_cost_from_bench(os.path.join(REPO, T.WEIGHT_SYNC_BENCH))
    assert cost.source.kind == "measured" and "bench_weight_sync" in cost.source.ref
    assert 0.05e9 < 1 / cost.seconds_per_byte < 50e9
    assert 0 <= cost.latency_s < 0.1


def _batch_results(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "bench_batch_transfer.json"
    path.write_text(json.dumps({"uptime": "up 1 day, load average: 1.00, 1.00, 1.00", "rows": rows}))
    return str(path)


def test_batch_cost_reads_one_methods_rows(tmp_path) -> None:
    """The scatter rows give the line and the bytes per token; broadcast rows are left out."""
    rows = [{"method": "scatter", "batch_bytes": b, "tokens": b // 20, "seconds": 1e-3 + b * 2e-10} for b in
            (20_000, 2_000_000, 200_000_000)]
    rows += [{"method": "broadcast", "batch_bytes": 20_000, "tokens": 1000, "seconds": 5.0}]
    cost = T.batch_cost_from_bench(_batch_results(tmp_path, rows))
    assert cost.latency_s == pytest.approx(1e-3) and cost.seconds_per_byte == pytest.approx(2e-10)
    assert cost.bytes_per_token == pytest.approx(20) and cost.source.kind == "measured"
    fitted = _batch_results(tmp_path, rows)
    data = json.loads(open(fitted).read())
    data["data_path_model"] = {"scatter": {"fixed_s": 0.1, "s_per_byte": 4e-9, "rows": 3}}
    open(fitted, "w").write(json.dumps(data))
    own = T.batch_cost_from_bench(fitted)  # the benchmark's own line wins over a refit
    assert (own.latency_s, own.seconds_per_byte) == (0.1, 4e-9) and "data_path_model" in own.source.ref
    with pytest.raises(WorkloadError, match="two or more sizes"):  # one broadcast row: no line
        T.batch_cost_from_bench(_batch_results(tmp_path, rows), "broadcast")
    with pytest.raises(WorkloadError, match="no rows of method 'pipe'"):
        T.batch_cost_from_bench(_batch_results(tmp_path, rows), "pipe")
    with pytest.raises(WorkloadError, match="no results"):
        T.batch_cost(f"measured:{tmp_path / 'none.json'}", builtin_profile("H100"))
    with pytest.raises(WorkloadError, match="--batch-path fast"):
        T.batch_cost("fast", builtin_profile("H100"))
    assert T.batch_cost("assumed", builtin_profile("H100")).source.kind == "assumed"


def test_batch_cost_from_the_committed_batch_transfer_benchmark() -> None:
    cost = T.batch_cost_from_bench(os.path.join(REPO, T.BATCH_TRANSFER_BENCH))
    assert cost.source.kind == "measured" and cost.seconds_per_byte > 0 and 4 <= cost.bytes_per_token <= 64


def test_sync_uses_the_measured_cost_of_the_busiest_gpu() -> None:
    """Measured: latency + the plan's busiest-GPU bytes x seconds/byte + pause/resume."""
    spec, hw = known_model("qwen2-1.5b"), builtin_profile("H800")
    lay = RunLayout(1, 2, Strategy(1, 1, 2), gpus_per_node=8)
    plan = plan_reshard(spec, Layout(Mesh(2, 2), lay.train), Layout(Mesh(0, 2), Strategy(2, 1, 1)), 8)
    cost = T.LinkCost(0.01, 1e-9, T.Source("assumed", "test"))
    busiest = max(plan.max_recv_bytes(), plan.max_send_bytes())
    assert sync_seconds(spec, hw, lay, cost) == pytest.approx(0.01 + busiest * 1e-9 + hw.eff.weight_update_overhead_s)
    link = sync_seconds(spec, hw, lay)
    assert link == pytest.approx(plan.estimate_seconds(hw.gpu.nvlink_gbps * hw.eff.link, hw.gpu.ib_gbps * hw.eff.link)
                                 + hw.eff.weight_update_overhead_s)


def test_the_batch_term_adds_to_each_train_step() -> None:
    spec, hw = known_model("qwen2-1.5b"), builtin_profile("H800")
    kw = dict(train_mb_tokens=32768, minibatches=4, gpus_per_node=8, sync_seconds=1.0)
    free = trainer_model(spec, hw, Strategy(2, 1, 2), batch_link=T.LinkCost(0.0, 0.0, T.Source("assumed", "0")), **kw)
    slow = trainer_model(spec, hw, Strategy(2, 1, 2), batch_link=T.LinkCost(0.5, 1e-9, T.Source("assumed", "x"),
                                                                             bytes_per_token=24), **kw)
    n, p, a = 64, 64 * 1024, 64 * 4000
    assert slow.train_seconds(n, p, a) - free.train_seconds(n, p, a) == pytest.approx(0.5 + (p + a) * 24 * 1e-9)

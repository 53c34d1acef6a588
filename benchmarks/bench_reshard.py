"""Resharding: our plan vs gather-then-broadcast (what most RL systems do).

Part 1 (computed): bytes moved for 7B/32B/70B train -> generate layouts on H100 nodes
(8 GPUs/node), and the time the busiest GPU needs at link speed (NVLink 450 GB/s, IB
50 GB/s per GPU, 75% efficiency: estimates, not measurements).
Part 2 (measured): a small real model on 4 gloo processes (CPU), wall time of both
methods, median of --repeats runs, with the results checked bit-identical.

    python benchmarks/bench_reshard.py            # both parts, writes results/bench_reshard.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reshard_baseline  # noqa: E402 - beside this script (benchmark-only)
from realscale.parallel.mesh import Layout, Mesh, Strategy  # noqa: E402
from realscale.parallel.model_spec import known_model, transformer_spec  # noqa: E402

NVLINK, IB, EFF, GPN = 450.0, 50.0, 0.75, 8


def lay(text: str, start: int) -> Layout:
    s = Strategy.parse(text)
    return Layout(Mesh(start, s.world), s)


COMPUTED = [
    ("qwen2-7b", "colocated", lay("d2t4p2", 0), lay("d4t4p1", 0)),
    ("qwen2-7b", "disaggregated", lay("d4t4p2", 0), lay("d8t4p1", 32)),
    ("qwen2-32b", "colocated", lay("d4t8p2", 0), lay("d16t4p1", 0)),
    ("qwen2-32b", "disaggregated", lay("d2t8p4", 0), lay("d16t4p1", 64)),
    ("qwen2-70b", "colocated", lay("d8t8p4", 0), lay("d32t8p1", 0)),
    ("qwen2-70b", "disaggregated", lay("d4t8p4", 0), lay("d16t8p1", 128)),
    # a mixture of experts (128 experts): each trainer rank holds 1/8 of them (ep8), the
    # servers every expert; the plan of configs/qwen3_30b_a3b_math.yaml, and a colocated twin
    ("qwen3-30b-a3b", "disaggregated", lay("d16t1p1e8", 48), lay("d12t4p1", 0)),
    ("qwen3-30b-a3b", "colocated", lay("d8t1p1e8", 0), lay("d2t4p1", 0)),
]


def computed() -> list[dict]:
    from realscale.parallel.reshard import lower_bound_elems, plan_reshard

    rows = []
    for model, kind, src, dst in COMPUTED:
        spec = known_model(model)
        t0 = time.perf_counter()
        plan = plan_reshard(spec, src, dst, gpus_per_node=GPN)
        plan_s = time.perf_counter() - t0
        lb = sum(lower_bound_elems(spec, src, dst).values()) * spec.itemsize
        assert plan.total_recv_bytes() == lb
        base = reshard_baseline.volume(spec, src, dst)
        ours_s = plan.estimate_seconds(NVLINK * EFF, IB * EFF)
        base_s = reshard_baseline.estimate_seconds(spec, src, dst, GPN, NVLINK * EFF, IB * EFF)
        rows.append({"model": model, "kind": kind, "src": str(src), "dst": str(dst),
                     "ours_total_GB": plan.total_recv_bytes() / 1e9, "base_total_GB": sum(base.values()) / 1e9,
                     "ours_max_gpu_GB": plan.max_recv_bytes() / 1e9, "base_max_gpu_GB": max(base.values()) / 1e9,
                     "ours_cross_node_GB": plan.cross_node_bytes() / 1e9,
                     "ours_est_s": ours_s, "base_est_s": base_s, "speedup_est": base_s / ours_s if ours_s else None,
                     "plan_seconds": plan_s})
    return rows


def _measure(cases, repeats):
    """Per rank: for each case, best-of wall times of ours and of the baseline."""
    import torch
    import torch.distributed as dist

    from realscale.parallel.reshard import plan_reshard
    from realscale.parallel.reshard_exec import Resharder, pack_shard

    rank = dist.get_rank()
    out = []
    for spec_kw, src, dst in cases:
        spec = transformer_spec(**spec_kw)
        g = torch.Generator().manual_seed(0)
        full = {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}
        sbuf = pack_shard(spec, src, rank, full)
        want = pack_shard(spec, dst, rank, full)
        del full
        rs = Resharder(plan_reshard(spec, src, dst, gpus_per_node=GPN), bucket_bytes=32 << 20)
        groups: dict = {}
        t_ours, t_base = [], []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            got, st = rs.run(sbuf, dtype=torch.float32)
            dist.barrier()
            t_ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got_b, recv_b = reshard_baseline.gather_broadcast(spec, src, dst, sbuf, torch.float32, groups)
            dist.barrier()
            t_base.append(time.perf_counter() - t0)
        ok = (want is None and got is None) or (torch.equal(got, want) and torch.equal(got_b, want))
        out.append({"ours_s": statistics.median(t_ours), "base_s": statistics.median(t_base),
                    "ours_recv": st.recv_bytes, "base_recv": recv_b, "identical": bool(ok)})
    return out


MEASURED_SPEC = dict(hidden=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn=1536, vocab=16384, itemsize=4)
MEASURED = [(MEASURED_SPEC, lay("d1t2p2", 0), lay("d2t2p1", 0)),
            (MEASURED_SPEC, lay("d2t1p2", 0), lay("d1t4p1", 0)),
            (MEASURED_SPEC, lay("d1t4p1", 0), lay("d4t1p1", 0)),
            (MEASURED_SPEC, lay("d1t2p1", 0), lay("d1t2p1", 2))]


def measured(repeats: int) -> list[dict]:
    from realscale.parallel.spawn import run_distributed

    per_rank = run_distributed(_measure, 4, MEASURED, repeats, timeout=600)
    rows = []
    for ci, (kw, src, dst) in enumerate(MEASURED):
        rs = [per_rank[r][ci] for r in range(4)]
        ours = max(r["ours_s"] for r in rs)
        base = max(r["base_s"] for r in rs)
        rows.append({"src": str(src), "dst": str(dst), "params_M": transformer_spec(**kw).n_params / 1e6,
                     "ours_MB": sum(r["ours_recv"] for r in rs) / 1e6, "base_MB": sum(r["base_recv"] for r in rs) / 1e6,
                     "ours_s": ours, "base_s": base, "speedup": base / ours, "identical": all(r["identical"] for r in rs)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-measured", action="store_true")
    args = ap.parse_args()
    comp = computed()
    print("## computed volume (H100 nodes of 8; time = busiest GPU at 75% of link speed, an estimate)")
    print(f"{'model':13} {'kind':13} {'train -> gen':38} {'ours GB':>9} {'base GB':>9} {'max/GPU ours':>12} "
          f"{'max/GPU base':>12} {'ours s':>7} {'base s':>7} {'ratio':>6} {'plan s':>6}")
    for r in comp:
        print(f"{r['model']:13} {r['kind']:13} {r['src'] + ' -> ' + r['dst']:38} {r['ours_total_GB']:9.1f} "
              f"{r['base_total_GB']:9.1f} {r['ours_max_gpu_GB']:12.2f} {r['base_max_gpu_GB']:12.2f} "
              f"{r['ours_est_s']:7.2f} {r['base_est_s']:7.2f} {r['speedup_est']:6.1f}x {r['plan_seconds']:6.2f}")
    meas = []
    if not args.skip_measured:
        meas = measured(args.repeats)
        print("\n## measured on 4 gloo processes (CPU, fp32), median of", args.repeats)
        print(f"{'train -> gen':40} {'params M':>8} {'ours MB':>8} {'base MB':>8} {'ours s':>7} {'base s':>7} "
              f"{'speedup':>7} identical")
        for r in meas:
            print(f"{r['src'] + ' -> ' + r['dst']:40} {r['params_M']:8.1f} {r['ours_MB']:8.1f} {r['base_MB']:8.1f} "
                  f"{r['ours_s']:7.3f} {r['base_s']:7.3f} {r['speedup']:6.2f}x {r['identical']}")
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_reshard.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"computed": comp, "measured": meas, "cpu_count": os.cpu_count()}, fh, indent=2)
    print(f"\nwrote {path}")
    return 0 if all(r["identical"] for r in meas) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Weight sync in the loop: the resharder vs gather-to-rank-0-then-broadcast, into real servers.

What one RL step's weight update costs, from real Megatron trainer ranks (tiny-qwen2 and
small-qwen2; layouts tp2 = d1t2p1, pp2 = d1t1p2, tp2xpp2 = d1t2p2) into real embedded
generation servers (``realscale serve`` processes, started as ``realscale train`` starts
them) laid out as (a) two 1-rank servers or (b) one server with 2 tensor-parallel ranks
(two processes), side by side in one run, on gloo. Both methods are the transports the
loop runs, called as the trainer calls them (``transport.send(engine, version, control)``
on every trainer rank; HTTP control included, pause/resume not):

- **reshard** (``ReshardTransport``, the default for embedded servers): every trainer
  rank packs its local Megatron shards into its flat buffer and the resharder sends each
  server rank exactly the slices of its shard, from whichever trainer rank holds them;
  each server rank receives in its own process, into its weight buffer.
- **gather-broadcast** (``BroadcastTransport``, SGLang's protocol, the scheme of
  ``benchmarks/reshard_baseline.py``): the trainer's export gathers every tensor
  over TP and down the pipeline to rank 0, which broadcasts each HF tensor to every
  server rank; each server rank cuts its own Megatron-layout shard from the full tensors.

Seconds per step: median of ``--repeats`` sends (after one untimed send that builds the
groups), on trainer rank 0 from a barrier of the trainer ranks until every server answered
that it holds the new version. The weights change before every send; after the last one
every server rank's hash per tensor is compared with the trainer's exported weights
(``/realscale/weight_hashes``), for both methods.

    python benchmarks/bench_weight_sync.py            # writes results/bench_weight_sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "publish"))  # weight_world_cases: perturb, server_check

LAYOUTS = {"tp2": "d1t2p1", "pp2": "d1t1p2", "tp2xpp2": "d1t2p2"}
DESTINATIONS = {"2 x 1-rank": (2, 1), "1 x 2-rank": (1, 2)}  # (servers, ranks each)
BUCKET = 64 << 20


def _timed_sends(engine, transport, control, repeats: int, version: int) -> tuple[list[float], object, int]:
    """One untimed send, then ``repeats`` timed ones, the weights changed before each."""
    import torch.distributed as dist
    from weight_world_cases import perturb

    times, stats = [], None
    for step in range(repeats + 1):
        version += 1
        perturb(engine, version)
        dist.barrier()
        t0 = time.perf_counter()
        stats = transport.send(engine, version, control)
        if step:
            times.append(time.perf_counter() - t0)
    return times, stats, version


def trainer(model: str, layouts: list[str], servers: dict[str, list[tuple[str, int]]], repeats: int) -> list[dict]:
    """Every trainer rank: per layout and destination, both transports; rank 0's rows."""
    import torch.distributed as dist
    from weight_world_cases import server_check

    from realscale.publish.broadcast import BroadcastTransport
    from realscale.publish.control import ClientControl, ServerEndpoint
    from realscale.publish.reshard import ReshardTransport
    from realscale.parallel.mesh import Strategy
    from realscale.train.engine import EngineConfig, MegatronEngine

    rank, rows, version = dist.get_rank(), [], 0
    for name in layouts:
        s = Strategy.parse(LAYOUTS[name])
        engine = MegatronEngine(EngineConfig(model, tp=s.tp, pp=s.pp, lr=None))
        for dst, endpoints in servers.items():
            control = ClientControl([ServerEndpoint(u, r) for u, r in endpoints]) if rank == 0 else None
            row: dict = {"layout": name, "trainer": LAYOUTS[name], "destination": dst}
            group = f"bench-{name}-{dst.replace(' ', '')}"  # a weight-group name is taken once per process
            ours = ReshardTransport("gloo", bucket_bytes=BUCKET, timeout_s=900)
            base = BroadcastTransport("gloo", bucket_bytes=BUCKET, group_name=group)
            for method, transport in (("ours", ours), ("base", base)):
                transport.connect(engine, control)
                times, stats, version = _timed_sends(engine, transport, control, repeats, version)
                held = server_check(engine, ours.spec, ours.member.world, endpoints)
                row.update({f"{method}_s": statistics.median(times), f"{method}_bytes": stats.bytes,
                            f"{method}_identical": held is None or all(not h["differ"] for h in held)})
            row["lower_bound"] = ours.member.lower_bound_bytes()
            ours.close()
            base.close()
            if control is not None:
                for url, _ in endpoints:  # the servers leave the broadcast group
                    control.run(lambda c, u=url: c.post(u, "/destroy_weights_update_group", {"group_name": group}))
                control.close()
            row["speedup"] = row["base_s"] / row["ours_s"]
            rows.append(row)
    return rows


def run_model(model_name: str, repeats: int, log_dir: str) -> list[dict]:
    from realscale.launcher.local import start_servers, stop_servers
    from realscale.models.tiny import resolve_model_path
    from realscale.parallel.spawn import run_distributed

    model = resolve_model_path(model_name)
    procs, servers = [], {}
    try:
        for dst, (num, tp) in DESTINATIONS.items():
            started = start_servers(model, num, os.path.join(log_dir, model_name, dst.replace(" ", "")), tp=tp,
                                    max_running=4, context_length=128, timeout=600)
            procs += started
            servers[dst] = [(s.url, tp) for s in started]
        rows = []
        for layouts, trainer_ranks in ((["tp2", "pp2"], 2), (["tp2xpp2"], 4)):
            rows += run_distributed(trainer, trainer_ranks, model, layouts, servers, repeats, timeout=3000)[0]
    finally:
        stop_servers(procs)
    return [{"model": model_name, **r} for r in rows]


def table(rows: list[dict]) -> str:
    head = ("model", "trainer", "servers", "reshard MB", "lower bound MB", "gather-bcast MB", "reshard s",
            "gather-bcast s", "speedup", "identical")
    lines = [head]
    for r in rows:
        lines.append((r["model"], f"{r['layout']} ({r['trainer']})", r["destination"], f"{r['ours_bytes'] / 1e6:.2f}",
                      f"{r['lower_bound'] / 1e6:.2f}", f"{r['base_bytes'] / 1e6:.2f}", f"{r['ours_s']:.3f}",
                      f"{r['base_s']:.3f}", f"{r['speedup']:.2f}x", str(r["ours_identical"] and r["base_identical"])))
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-qwen2,small-qwen2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_weight_sync.json"))
    args = ap.parse_args()
    t0, uptime = time.time(), os.popen("uptime").read().strip()
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as logs:
        rows = [r for m in args.models.split(",") for r in run_model(m, args.repeats, logs)]
    print(table(rows))
    multi = [r["speedup"] for r in rows if r["destination"] == "1 x 2-rank"]
    at_bound = all(r["ours_bytes"] == r["lower_bound"] for r in rows)
    identical = all(r["ours_identical"] and r["base_identical"] for r in rows)
    print(f"bytes = lower bound: {at_bound}; every server rank bit-identical: {identical}; speedup where a server "
          f"has 2 ranks: min {min(multi):.2f}x, median {statistics.median(multi):.2f}x")
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"command": "python benchmarks/bench_weight_sync.py " + " ".join(sys.argv[1:]),
                   "uptime_at_start": uptime, "uptime_at_end": os.popen("uptime").read().strip(),
                   "seconds": round(time.time() - t0, 1), "repeats": args.repeats, "rows": rows,
                   "bytes_at_lower_bound": at_bound, "identical": identical}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0 if at_bound and identical else 1


if __name__ == "__main__":
    sys.exit(main())

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
- **gather-broadcast** (``BroadcastTransport(per_stage=False)``, SGLang's protocol, the
  scheme of ``benchmarks/reshard_baseline.py``): the trainer's export gathers every tensor
  over TP and down the pipeline to rank 0, which broadcasts each HF tensor to every
  server rank; each server rank cuts its own Megatron-layout shard from the full tensors.
- **per-stage broadcast** (pipelined trainers only: ``BroadcastTransport``, what the loop
  sends SGLang servers, ``StageBroadcastTransport``): each stage's first rank gathers its
  own stage over TP and broadcasts it in a group of its own, nothing down the pipeline.

Seconds per step: median of ``--repeats`` sends (after one untimed send that builds the
groups), on trainer rank 0 from a barrier of the trainer ranks until every server answered
that it holds the new version. The weights change before every send; after the last one
every server rank's hash per tensor is compared with the trainer's exported weights
(``/realscale/weight_hashes``), for both methods.

    python benchmarks/bench_weight_sync.py            # writes results/bench_weight_sync.json

``--vllm``: the vLLM-CPU path instead (``generate.backend=vllm``): the same trainer layouts
push a tiny Llama (head size 32, vLLM-CPU's smallest) into two vLLM-CPU servers of 2
tensor-parallel workers each, one started with realscale's ``gloo_m2n`` engine (the twin
of vLLM's shard-to-shard ``nccl_m2n``: every trainer rank sends its local shards) and one
with ``gloo`` (the twin of the broadcast ``nccl``: rank 0 gathers and broadcasts), each
through ``VllmEngineTransport`` as the loop calls it (start -> update -> finish, HTTP
included). Seconds per step: median of ``--repeats`` sends after one untimed send, the
weights changed before each step; afterwards both servers' workers' weights
(``/collective_rpc save_sharded_state``) must be bit-identical.

    python benchmarks/bench_weight_sync.py --vllm     # writes results/bench_weight_sync_vllm.json
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
            methods = [("ours", ours), ("base", BroadcastTransport("gloo", bucket_bytes=BUCKET, group_name=group,
                                                                   per_stage=False))]
            if s.pp > 1:  # SGLang's protocol as the loop sends it from a pipelined trainer
                methods.append(("stage", BroadcastTransport("gloo", bucket_bytes=BUCKET, group_name=f"{group}-ps")))
            for method, transport in methods:
                transport.connect(engine, control)
                times, stats, version = _timed_sends(engine, transport, control, repeats, version)
                held = server_check(engine, ours.spec, ours.member.world, endpoints)
                row.update({f"{method}_s": statistics.median(times), f"{method}_bytes": stats.bytes,
                            f"{method}_identical": held is None or all(not h["differ"] for h in held)})
                if method != "ours":
                    transport.close()  # the servers leave its group(s)
            row["lower_bound"] = ours.member.lower_bound_bytes()
            ours.close()
            if control is not None:
                control.close()
            row["speedup"] = row["base_s"] / row["ours_s"]
            if "stage_s" in row:
                row["stage_speedup"] = row["base_s"] / row["stage_s"]
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
            "gather-bcast s", "speedup", "per-stage bcast s", "vs gather-bcast", "identical")
    lines = [head]
    for r in rows:
        staged = "stage_s" in r
        lines.append((r["model"], f"{r['layout']} ({r['trainer']})", r["destination"], f"{r['ours_bytes'] / 1e6:.2f}",
                      f"{r['lower_bound'] / 1e6:.2f}", f"{r['base_bytes'] / 1e6:.2f}", f"{r['ours_s']:.3f}",
                      f"{r['base_s']:.3f}", f"{r['speedup']:.2f}x", f"{r['stage_s']:.3f}" if staged else "-",
                      f"{r['stage_speedup']:.2f}x" if staged else "-",
                      str(r["ours_identical"] and r["base_identical"] and r.get("stage_identical", True))))
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


VLLM_ENGINES = ("m2n", "broadcast")  # generate.vllm_weight_engine of the two servers


def _vllm_states(url: str, out_dir: str, ranks: int) -> list[dict]:
    """Every worker's model state of a vLLM server (``/collective_rpc save_sharded_state``)."""
    import urllib.request

    from safetensors.torch import load_file

    os.makedirs(out_dir, exist_ok=True)
    req = urllib.request.Request(url + "/collective_rpc", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"method": "save_sharded_state", "kwargs": {"path": out_dir}}).encode())
    urllib.request.urlopen(req, timeout=600).read()
    return [load_file(os.path.join(out_dir, f"model-rank-{r}-part-0.safetensors")) for r in range(ranks)]


def vllm_trainer(model: str, layouts: list[str], servers: dict[str, str], repeats: int, out_dir: str) -> list[dict]:
    """Every trainer rank: per layout, both vLLM transports into their servers; rank 0's rows."""
    import torch
    import torch.distributed as dist
    from weight_world_cases import perturb

    from realscale.inference.client import InferenceClient
    from realscale.inference.vllm_dialect import VllmDialect
    from realscale.parallel.mesh import Strategy
    from realscale.publish.control import ServerControl, ServerEndpoint, _NoRollouts
    from realscale.publish.vllm import VllmEngineTransport
    from realscale.train.engine import EngineConfig, MegatronEngine

    rank, rows, version = dist.get_rank(), [], 0
    for name in layouts:
        s = Strategy.parse(LAYOUTS[name])
        engine = MegatronEngine(EngineConfig(model, tp=s.tp, pp=s.pp, lr=None))
        pairs = {}
        for kind in VLLM_ENGINES:
            control = None
            if rank == 0:  # the trainer's control without a rollout controller, speaking vLLM's dialect
                url = servers[kind]
                control = ServerControl(_NoRollouts(), [ServerEndpoint(url, 2)],
                                        lambda u=url: InferenceClient([u], dialect=VllmDialect(), request_timeout=600))
            transport = VllmEngineTransport("gloo_m2n" if kind == "m2n" else "gloo", bucket_bytes=BUCKET)
            transport.connect(engine, control)
            pairs[kind] = (transport, control)
        times: dict[str, list[float]] = {k: [] for k in VLLM_ENGINES}
        stats = {}
        for step in range(repeats + 1):
            version += 1
            perturb(engine, version)
            for kind, (transport, control) in pairs.items():
                dist.barrier()
                t0 = time.perf_counter()
                stats[kind] = transport.send(engine, version, control)
                if step:
                    times[kind].append(time.perf_counter() - t0)
        row: dict = {"layout": name, "trainer": LAYOUTS[name], "destination": "1 x 2-rank vLLM-CPU"}
        for kind in VLLM_ENGINES:
            row.update({f"{kind}_s": statistics.median(times[kind]), f"{kind}_bytes": stats[kind].bytes,
                        f"{kind}_lower_bound": stats[kind].lower_bound})
        dist.barrier()
        if rank == 0:
            states = {k: _vllm_states(servers[k], os.path.join(out_dir, f"{name}-{k}"), 2) for k in VLLM_ENGINES}
            row["identical"] = all(a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
                                   for a, b in zip(states["m2n"], states["broadcast"]))
            row["speedup"] = row["broadcast_s"] / row["m2n_s"]
            rows.append(row)
        for transport, control in pairs.values():
            transport.close()
            if control is not None:
                control.close()
        dist.barrier()
    return rows


def run_vllm(repeats: int, log_dir: str) -> list[dict]:
    from realscale.config import GenerateConfig
    from realscale.launcher.local import spawn_engine_server, stop_servers, wait_healthy
    from realscale.models.tiny import build_tiny_model
    from realscale.parallel.spawn import run_distributed

    model = build_tiny_model(os.path.join(log_dir, "tiny-llama"), family="llama", hidden_size=64, num_layers=2,
                             num_heads=2, num_kv_heads=2, intermediate_size=128, seed=0)
    gens = {k: GenerateConfig(backend="vllm", tp=2, max_running_requests=4, context_length=128, vllm_kv_cache_mb=128,
                              vllm_enforce_eager=True, vllm_weight_engine=k) for k in VLLM_ENGINES}
    procs = [spawn_engine_server(model, g, os.path.join(log_dir, f"vllm-{k}.log"), seed=1) for k, g in gens.items()]
    try:
        for p in procs:
            wait_healthy(p, 900, what="vLLM server")
        servers = {k: p.url for k, p in zip(gens, procs)}
        rows = []
        for layouts, trainer_ranks in ((["tp2", "pp2"], 2), (["tp2xpp2"], 4)):
            rows += run_distributed(vllm_trainer, trainer_ranks, model, layouts, servers, repeats, log_dir,
                                    timeout=3000)[0]
    finally:
        stop_servers(procs)
    return [{"model": "tiny-llama", **r} for r in rows]


def vllm_table(rows: list[dict]) -> str:
    head = ("model", "trainer", "servers", "m2n MB", "m2n lower bound MB", "broadcast MB", "m2n s", "broadcast s",
            "speedup", "identical")
    lines = [head]
    for r in rows:
        lines.append((r["model"], f"{r['layout']} ({r['trainer']})", r["destination"], f"{r['m2n_bytes'] / 1e6:.3f}",
                      f"{r['m2n_lower_bound'] / 1e6:.3f}", f"{r['broadcast_bytes'] / 1e6:.3f}", f"{r['m2n_s']:.3f}",
                      f"{r['broadcast_s']:.3f}", f"{r['speedup']:.2f}x", str(r["identical"])))
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main_vllm(args: argparse.Namespace) -> int:
    t0, uptime = time.time(), os.popen("uptime").read().strip()
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_vllm_") as logs:
        rows = run_vllm(args.repeats, logs)
    print(vllm_table(rows))
    at_bound = all(r["m2n_bytes"] == r["m2n_lower_bound"] for r in rows)
    identical = all(r["identical"] for r in rows)
    print(f"m2n bytes = its lower bound: {at_bound}; both servers' workers bit-identical: {identical}")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", "bench_weight_sync_vllm.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"command": "python benchmarks/bench_weight_sync.py " + " ".join(sys.argv[1:]),
                   "uptime_at_start": uptime, "uptime_at_end": os.popen("uptime").read().strip(),
                   "seconds": round(time.time() - t0, 1), "repeats": args.repeats, "rows": rows,
                   "bytes_at_lower_bound": at_bound, "identical": identical}, fh, indent=1)
    print(f"wrote {out}")
    return 0 if at_bound and identical else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-qwen2,small-qwen2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vllm", action="store_true", help="the vLLM-CPU rows: gloo_m2n vs gloo broadcast (docstring)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.vllm:
        return main_vllm(args)
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", "bench_weight_sync.json")
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

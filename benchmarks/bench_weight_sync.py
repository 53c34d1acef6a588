"""Weight sync in the loop: the resharder vs gather-to-rank-0-then-broadcast.

What one RL step's weight update moves, from real Megatron trainer ranks (tiny-qwen2 and
small-qwen2; layouts tp2 = d1t2p1, pp2 = d1t1p2, tp2xpp2 = d1t2p2) into two destination
ranks laid out as (a) two 1-rank servers or (b) one 2-rank server, side by side in one
run, on gloo:

- **reshard** (``ReshardTransport``'s data path): every trainer rank packs its local
  Megatron shards into its flat buffer and the resharder sends each server rank exactly
  the slices of its shard, from whichever trainer rank holds them.
- **gather-broadcast** (``BroadcastTransport``'s data path, the scheme of
  ``realscale/parallel/reshard_baseline.py``): the trainer's export gathers every tensor
  over TP and down the pipeline to rank 0, which broadcasts each HF tensor to every
  server rank (``WeightSender``); each server rank then cuts its own Megatron-layout
  shard from the full tensors.

Destination ranks are processes doing what a server rank does with each transport
(receive, and for the baseline convert), without HTTP. Both results are checked
bit-identical to the trainer's weights. Seconds per step: median of ``--repeats`` steps,
from a barrier of all ranks to the last destination holding its shard.

    python benchmarks/bench_weight_sync.py            # writes results/bench_weight_sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = {"tp2": "d1t2p1", "pp2": "d1t1p2", "tp2xpp2": "d1t2p2"}
DESTINATIONS = {"2 x 1-rank": [1, 1], "1 x 2-rank": [2]}
BUCKET = 64 << 20


def _worlds(model: str, layouts: list[str]) -> list[dict]:
    """World templates (port 0: trainer rank 0 hosts each world's store and publishes it)."""
    import torch

    from realscale.generate.weight_world_routes import server_spec
    from realscale.parallel.weight_world import WorldSpec, spec_digest

    digest = spec_digest(server_spec(model, torch.float32))
    return [WorldSpec("127.0.0.1", 0, f"{name}/{dst}", "gloo", LAYOUTS[name], servers, spec_digest=digest,
                      bucket_bytes=BUCKET, timeout_s=900).to_json()
            for name in layouts for dst, servers in DESTINATIONS.items()]


def _join(board_addr: tuple[str, int], wj: dict, rank: int):
    import datetime

    import torch.distributed as dist

    from realscale.parallel.weight_world import WorldSpec, join_via_board

    board = dist.TCPStore(board_addr[0], board_addr[1], is_master=False, timeout=datetime.timedelta(seconds=900))
    return join_via_board(board, WorldSpec.from_json(wj), rank)


# ----------------------------------------------------------------------------- trainer side


def _baseline_send(engine, group, step: int) -> None:
    """Rank 0: each exported bucket's names/shapes to the store (the HTTP request of
    BroadcastTransport), then its tensors broadcast to every destination rank."""
    import torch.distributed as dist

    from realscale.generate.weight_sync import bucket_meta

    buckets = engine.export_hf_weights(bucket_bytes=BUCKET)
    i = 0
    for bucket in buckets:
        if dist.get_rank() == 0:
            group["store"].set(f"meta/{step}/{i}", json.dumps(bucket_meta(bucket)))
            group["sender"].broadcast_bucket(bucket)
        i += 1
    if dist.get_rank() == 0:
        group["store"].set(f"meta/{step}/{i}", "null")


def trainer(model: str, worlds: list[dict], board: tuple[str, int], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from realscale.generate.weight_sync import WeightSender
    from realscale.models.convert import local_params
    from realscale.parallel.device import comm_empty
    from realscale.parallel.mesh import Strategy
    from realscale.parallel.model_spec import spec_from_hf_config
    from realscale.parallel.weight_world import WorldMember, pack_megatron
    from realscale.train.engine import EngineConfig, MegatronEngine

    out, engine, built = [], None, None
    for wj in worlds:
        world, store = _join(board, wj, dist.get_rank())
        if built != world.trainer:
            s = Strategy.parse(world.trainer)
            engine = MegatronEngine(EngineConfig(model, tp=s.tp, pp=s.pp, lr=None))
            built = world.trainer
        spec = spec_from_hf_config(engine.hf_config, itemsize=4)
        member = WorldMember(world, dist.get_rank(), spec, store)
        src, _ = world.layouts()
        buf = comm_empty(member.resharder.src_idx.numel, torch.float32, world.backend)
        group = {"store": member.group.store}
        if dist.get_rank() == 0:  # the broadcast group: rank 0 + every destination rank
            group["sender"] = WeightSender(world.master_address, 0, world.server_ranks + 1, group_name=world.name,
                                           backend="gloo")
        ours, base, sent = [], [], 0
        for step in range(repeats):
            member.group.barrier()
            t0 = time.perf_counter()
            pack_megatron(local_params(engine.model), spec, src, dist.get_rank(), buf)
            sent += member.send(buf).send_bytes
            member.group.barrier()
            ours.append(time.perf_counter() - t0)
        if dist.get_rank() == 0:
            _connect_sender(group, member)
        for step in range(repeats):
            member.group.barrier()
            t0 = time.perf_counter()
            _baseline_send(engine, group, step)
            member.group.barrier()
            base.append(time.perf_counter() - t0)
        out.append({"world": world.name, "ours_s": statistics.median(ours), "base_s": statistics.median(base),
                    "lower_bound": member.lower_bound_bytes(), "full_bytes": engine.hf_weight_bytes()})
        member.group.barrier()
        member.close()
    return out


def _connect_sender(group: dict, member) -> None:
    """Rank 0 hosts the broadcast group on a fresh port it publishes in the world's store."""
    from realscale.parallel.spawn import free_port

    sender = group["sender"]
    sender.master_port = free_port()
    member.group.store.set("bport", str(sender.master_port))
    sender.connect(timeout_s=900)


# ----------------------------------------------------------------------------- destination side


def destination(model: str, worlds: list[dict], board: tuple[str, int], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from realscale.generate.weight_sync import WeightReceiver
    from realscale.generate.weight_world_routes import server_spec, spec_full_from_hf
    from realscale.models.family import load_arch
    from realscale.parallel.reshard_exec import pack_shard
    from realscale.parallel.weight_world import WorldMember, WorldSpec

    spec, arch = server_spec(model, torch.float32), load_arch(model)
    out = []
    for wj in worlds:
        rank = WorldSpec.from_json(wj).trainer_ranks + dist.get_rank()
        world, _ = _join(board, wj, rank)
        member = WorldMember(world, rank, spec)
        _, dst = world.layouts()
        ours = torch.empty(member.shard_numel())
        recv = 0
        for _ in range(repeats):
            member.group.barrier()
            recv = member.receive(ours).recv_bytes
            member.group.barrier()
        receiver = WeightReceiver()
        port = int(member.group.store.get("bport"))
        receiver.init_group(world.master_address, port, 1 + dist.get_rank(), world.server_ranks + 1, world.name,
                            "gloo", torch.device("cpu"), timeout_s=900)
        base, base_recv = None, 0
        for step in range(repeats):
            member.group.barrier()
            full, i, base_recv = {}, 0, 0
            while True:
                meta = json.loads(member.group.store.get(f"meta/{step}/{i}"))
                if meta is None:
                    break
                for name, t in receiver.receive(meta["names"], meta["dtypes"], meta["shapes"], world.name):
                    full[name] = t
                    base_recv += t.numel() * t.element_size()
                i += 1
            base = pack_shard(spec, dst, rank, spec_full_from_hf(spec, full, arch))  # this rank's Megatron shard
            member.group.barrier()
        out.append({"world": world.name, "ours_recv": recv, "base_recv": base_recv,
                    "identical": bool(torch.equal(ours, base))})
        member.group.barrier()
        member.close()
    return out


# ----------------------------------------------------------------------------- driver


def run_model(model_name: str, repeats: int) -> list[dict]:
    import datetime

    import torch.distributed as dist

    from realscale.models.tiny import resolve_model_path
    from realscale.parallel.spawn import DistributedJob, run_distributed

    model = resolve_model_path(model_name)
    board = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=900), wait_for_workers=False)
    rows = []
    for layouts, trainer_ranks in ((["tp2", "pp2"], 2), (["tp2xpp2"], 4)):
        worlds = _worlds(model, layouts)
        dest = DistributedJob(destination, 2, model, worlds, ("127.0.0.1", board.port), repeats)
        try:
            trainers = run_distributed(trainer, trainer_ranks, model, worlds, ("127.0.0.1", board.port), repeats,
                                       timeout=3000)
        except BaseException:
            dest.kill()
            raise
        dests = dest.wait(timeout=600)
        for wi, wj in enumerate(worlds):
            t = trainers[0][wi]
            d = [dests[r][wi] for r in range(2)]
            layout, dst = wj["name"].split("/")
            rows.append({"model": model_name, "layout": layout, "trainer": wj["trainer"], "destination": dst,
                         "ours_bytes": sum(x["ours_recv"] for x in d), "base_bytes": sum(x["base_recv"] for x in d),
                         "lower_bound": t["lower_bound"], "full_model_bytes": t["full_bytes"],
                         "ours_s": t["ours_s"], "base_s": t["base_s"], "speedup": t["base_s"] / t["ours_s"],
                         "identical": all(x["identical"] for x in d)})
    return rows


def table(rows: list[dict]) -> str:
    head = ("model", "trainer", "destination", "reshard MB", "lower bound MB", "gather-bcast MB", "reshard s",
            "gather-bcast s", "speedup", "identical")
    lines = [head]
    for r in rows:
        lines.append((r["model"], f"{r['layout']} ({r['trainer']})", r["destination"], f"{r['ours_bytes'] / 1e6:.2f}",
                      f"{r['lower_bound'] / 1e6:.2f}", f"{r['base_bytes'] / 1e6:.2f}", f"{r['ours_s']:.3f}",
                      f"{r['base_s']:.3f}", f"{r['speedup']:.2f}x", str(r["identical"])))
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-qwen2,small-qwen2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "bench_weight_sync.json"))
    args = ap.parse_args()
    t0 = time.time()
    rows = [r for m in args.models.split(",") for r in run_model(m, args.repeats)]
    print(table(rows))
    multi = [r["speedup"] for r in rows if r["destination"] == "1 x 2-rank"]
    at_bound = all(r["ours_bytes"] == r["lower_bound"] for r in rows)
    print(f"bytes = lower bound: {at_bound}; speedup where a server has 2 ranks: "
          f"min {min(multi):.2f}x, median {statistics.median(multi):.2f}x")
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"command": "python benchmarks/bench_weight_sync.py " + " ".join(sys.argv[1:]),
                   "uptime": os.popen("uptime").read().strip(), "seconds": round(time.time() - t0, 1),
                   "repeats": args.repeats, "rows": rows, "bytes_at_lower_bound": at_bound}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0 if at_bound and all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

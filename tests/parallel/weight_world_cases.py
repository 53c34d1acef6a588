"""Workers of the weight-world tests (spawned processes import this module).

Trainer side: real Megatron engines (tiny models) pack their local shards and send.
Destination side: processes that do exactly what a generation-server rank does with the
reshard transport — join the world at their rank, receive into a flat buffer in
``shard_index`` order — and report a hash per tensor of that buffer.

Ground truth: the trainer's weights exported to full HF tensors (gathered over TP and
down the pipeline: a different path from the resharder's), converted to the spec's full
Megatron tensors and sliced for each destination rank with ``pack_shard``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def rendezvous(rdzv: tuple[str, int], template: dict, rank: int) -> tuple[Any, Any]:
    """(world, hosted store) through the test's rendezvous store (``join_via_board``)."""
    import datetime

    import torch.distributed as dist

    from realscale.parallel.weight_world import WorldSpec, join_via_board

    board = dist.TCPStore(rdzv[0], rdzv[1], is_master=False, timeout=datetime.timedelta(seconds=900))
    return join_via_board(board, WorldSpec.from_json(template), rank)


def host_rendezvous() -> tuple[Any, tuple[str, int]]:
    """The test process's rendezvous store (keep the returned object alive)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=900), wait_for_workers=False)
    return store, ("127.0.0.1", store.port)


def tensor_hashes(spec: Any, idx: Any, buf: torch.Tensor) -> dict[str, str]:
    """sha1 of each tensor's bytes in a flat shard buffer."""
    from realscale.parallel.reshard_exec import unpack_shard

    return {name: hashlib.sha1(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for name, t in unpack_shard(spec, idx, buf).items()}


def expected_hashes(engine: Any, spec: Any, world: Any) -> dict[int, dict[str, str]] | None:
    """On trainer rank 0: each destination rank's tensor hashes from the exported weights;
    every trainer rank must call it (the export is collective)."""
    import torch.distributed as dist

    from realscale.generate.weight_world_routes import spec_full_from_hf
    from realscale.parallel.reshard import shard_index
    from realscale.parallel.reshard_exec import pack_shard

    hf = {n: t for bucket in engine.export_hf_weights() for n, t in bucket}
    if dist.get_rank() != 0:
        return None
    full = spec_full_from_hf(spec, hf, engine.arch)
    _, dst = world.layouts()
    return {g: tensor_hashes(spec, shard_index(spec, dst, g), pack_shard(spec, dst, g, full)) for g in dst.mesh.gpus}


@torch.no_grad()
def perturb(engine: Any, step: int) -> None:
    """Change every weight, keeping what training keeps equal equal: data-parallel
    replicas, tensor-parallel copies of replicated tensors (norms) and both copies of a
    tied embedding (the noise is seeded by the tensor's name and the step only)."""
    from realscale.models.convert import local_params

    for name, p in local_params(engine.model).items():
        key = "embedding.word_embeddings.weight" if name == "output_layer.weight" else name
        seed = int(hashlib.sha1(f"{key}/{step}".encode()).hexdigest()[:8], 16)
        g = torch.Generator().manual_seed(seed)
        noise = 0.01 * torch.randn(p.shape, generator=g)
        if key == "embedding.word_embeddings.weight":  # padded rows stay zero, as in training
            first = engine.ranks.tp_rank * p.shape[0]
            noise[max(0, engine.arch.vocab_size - first):] = 0
        p.add_(noise.to(p.device, p.dtype))


def trainer_worker(model_dir: str, cases: list[tuple[str, list[dict]]], rdzv: tuple[str, int],
                   steps: int = 2) -> list[dict]:
    """For each (trainer strategy, worlds): build the engine, then per world and step:
    pack, send, and (rank 0) the expected hashes."""
    import torch.distributed as dist

    from realscale.models.convert import local_params
    from realscale.parallel.device import comm_empty
    from realscale.parallel.mesh import Strategy
    from realscale.parallel.model_spec import spec_from_hf_config
    from realscale.parallel.weight_world import WorldMember, pack_megatron
    from realscale.train.engine import EngineConfig, MegatronEngine

    out = []
    for strategy, worlds in cases:
        s = Strategy.parse(strategy)
        engine = MegatronEngine(EngineConfig(model_dir, tp=s.tp, pp=s.pp, lr=None))
        spec = spec_from_hf_config(engine.hf_config, itemsize=4)
        for wj in worlds:
            world, store = rendezvous(rdzv, wj, dist.get_rank())
            member = WorldMember(world, dist.get_rank(), spec, store)
            src, _ = world.layouts()
            buf = comm_empty(member.resharder.src_idx.numel, torch.float32, world.backend)
            for step in range(steps):
                if step:
                    perturb(engine, step)
                pack_megatron(local_params(engine.model), spec, src, dist.get_rank(), buf)
                stats = member.send(buf)
                out.append({"world": world.name, "step": step, "sent": stats.send_bytes,
                            "expected": expected_hashes(engine, spec, world),
                            "lower_bound": member.lower_bound_bytes()})
            member.close()
    return out


def server_worker(model_dir: str, cases: list[tuple[str, list[dict]]], rdzv: tuple[str, int],
                  steps: int = 2) -> list[dict]:
    """Destination rank ``T + local rank`` of every world: receive, hash, report."""
    import torch.distributed as dist

    from realscale.generate.weight_world_routes import server_spec
    from realscale.parallel.weight_world import WorldMember, WorldSpec

    spec = server_spec(model_dir, torch.float32)
    out = []
    for _, worlds in cases:
        for wj in worlds:
            rank = WorldSpec.from_json(wj).trainer_ranks + dist.get_rank()
            world, _ = rendezvous(rdzv, wj, rank)
            member = WorldMember(world, rank, spec)
            buf = torch.full((member.shard_numel(),), float("nan"))
            for step in range(steps):
                stats = member.receive(buf)
                out.append({"world": world.name, "step": step, "rank": rank, "recv": stats.recv_bytes,
                            "hashes": tensor_hashes(spec, member.resharder.dst_idx, buf)})
            member.close()
    return out


def trainer_into_servers(model_dir: str, layouts: list[str], servers: dict[str, list[tuple[str, int]]],
                         steps: int = 2) -> list[dict]:
    """The running path: for each trainer layout and each set of real embedded servers,
    ReshardTransport.send as the trainer calls it, then (rank 0) every server rank's hash
    per tensor (``/realscale/weight_hashes``) next to the trainer's exported weights sliced
    for that rank and hashed the same way."""
    import json
    import urllib.request

    import torch.distributed as dist

    from realscale.generate.publish import ClientControl, ReshardTransport, ServerEndpoint
    from realscale.generate.weight_world_routes import spec_full_from_hf
    from realscale.generate.weights import tensor_hashes as server_hashes
    from realscale.parallel.mesh import Strategy
    from realscale.parallel.reshard import shard_index
    from realscale.parallel.reshard_exec import pack_shard
    from realscale.train.engine import EngineConfig, MegatronEngine

    rank, out, version = dist.get_rank(), [], 0
    for strategy in layouts:
        s = Strategy.parse(strategy)
        engine = MegatronEngine(EngineConfig(model_dir, tp=s.tp, pp=s.pp, lr=None))
        for dst, endpoints in servers.items():
            control = ClientControl([ServerEndpoint(u, r) for u, r in endpoints]) if rank == 0 else None
            transport = ReshardTransport("gloo", timeout_s=600)
            transport.connect(engine, control)
            for step in range(steps):
                if step:
                    perturb(engine, version)
                version += 1
                stats = transport.send(engine, version, control)
                hf = {n: t for bucket in engine.export_hf_weights() for n, t in bucket}
                if rank != 0:
                    continue
                spec, world = transport.member.spec, transport.member.world
                full = spec_full_from_hf(spec, hf, engine.arch)
                _, layout = world.layouts()
                for i, (url, ranks) in enumerate(endpoints):
                    with urllib.request.urlopen(url + "/realscale/weight_hashes", timeout=120) as resp:
                        got = json.loads(resp.read())
                    for k in range(ranks):
                        gpu = world.server_offset(i) + k
                        idx = shard_index(spec, layout, gpu)
                        out.append({"case": f"{strategy} -> {dst} server {i} rank {k} step {step}",
                                    "same": got["ranks"][k] == server_hashes(spec, idx, pack_shard(spec, layout, gpu,
                                                                                                   full)),
                                    "version": got["weight_version"] == str(version)})
                out.append({"case": f"{strategy} -> {dst} step {step}", "bytes": stats.bytes,
                            "lower_bound": stats.lower_bound})
            transport.close()
            if control is not None:
                control.close()
    return out

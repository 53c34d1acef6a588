"""Trainer ranks of the weight-world tests (spawned processes import this module).

Real Megatron engines (tiny models) run ``ReshardTransport`` exactly as the trainer does
into real embedded servers; rank 0 then reads every server rank's hash per tensor
(``/realscale/weight_hashes``) and compares it with the ground truth: the trainer's
weights exported to full HF tensors (gathered over TP and down the pipeline: a path
independent of the resharder's), converted to the spec's full Megatron tensors and
sliced for that server rank.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


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


def server_check(engine: Any, spec: Any, world: Any, endpoints: list[tuple[str, int]]) -> list[dict] | None:
    """Every server rank's tensor hashes against the trainer's exported weights sliced for
    it (every trainer rank must call this: the export is collective); rank 0 returns one
    record per server rank, the others None."""
    import json
    import urllib.request

    import torch.distributed as dist

    from realscale.serve.weights import full_megatron_tensors, shard_hashes

    named = [nt for bucket in engine.export_hf_weights() for nt in bucket]
    if dist.get_rank() != 0:
        return None
    full = full_megatron_tensors(named, spec, engine.arch)
    _, layout = world.layouts()
    out = []
    for i, (url, ranks) in enumerate(endpoints):
        with urllib.request.urlopen(url + "/realscale/weight_hashes", timeout=300) as resp:
            got = json.loads(resp.read())
        for k in range(ranks):
            want = shard_hashes(spec, layout, world.server_offset(i) + k, full)
            out.append({"server": i, "rank": k, "version": got["weight_version"],
                        "differ": sorted(n for n in want if got["ranks"][k].get(n) != want[n])})
    return out


def trainer_into_servers(model_dir: str, layouts: list[str], servers: dict[str, list[tuple[str, int]]],
                         steps: int = 2) -> list[dict]:
    """For each trainer layout and each set of servers (``name -> [(url, ranks)]``):
    ``ReshardTransport.connect`` once, then per step (weights changed after the first)
    ``send`` with a new version, as the trainer calls it, and :func:`server_check`.
    Returns this rank's records: bytes it sent, and on rank 0 what the servers received
    and hold."""
    import torch.distributed as dist

    from realscale.publish.control import ClientControl, ServerEndpoint
    from realscale.publish.reshard import ReshardTransport
    from realscale.parallel.mesh import Strategy
    from realscale.train.engine import EngineConfig, MegatronEngine

    rank, out, version = dist.get_rank(), [], 0
    for strategy in layouts:
        s = Strategy.parse(strategy)
        # a mixture of experts with tp > 1 runs under sequence parallelism (megatron's MoE layer)
        engine = MegatronEngine(EngineConfig(model_dir, tp=s.tp, pp=s.pp, ep=s.ep, lr=None,
                                             sequence_parallel=s.tp > 1 and s.ep > 1))
        for dst, endpoints in servers.items():
            control = ClientControl([ServerEndpoint(u, r) for u, r in endpoints]) if rank == 0 else None
            transport = ReshardTransport("gloo", timeout_s=600)
            transport.connect(engine, control)
            for step in range(steps):
                if step:
                    perturb(engine, version)
                version += 1
                stats = transport.send(engine, version, control)
                held = server_check(engine, transport.spec, transport.member.world, endpoints)
                out.append({"case": (strategy, dst, step), "sent": transport.sent_bytes, "version": str(version),
                            "bytes": stats.bytes, "lower_bound": stats.lower_bound,
                            "received": [transport.received.get(u) for u, _ in endpoints], "held": held})
            transport.close()
            if control is not None:
                control.close()
    return out


def lose_one_mid_transfer(model_dir: str, kind: str, endpoints: list[tuple[str, int]], victim_pgid: int) -> dict | None:
    """Two trainer ranks (tp2) push version 1 into both servers with the ``kind`` transport
    (``reshard``: the weight world; ``broadcast``: SGLang's weight group; ``broadcast-pp2``:
    a pp2 trainer's per-stage groups), then version 2, during which the second server is
    SIGKILLed — by rank 0 right before the world's send, or after the first bucket of the
    broadcast; with pp2 by stage 1's rank after its first bucket (its own group breaks
    while rank 0 posts that stage's part). The update must complete on the survivor
    (sent again in a group without the dead one); rank 0 returns what the survivor holds
    against the trainer's weights, and which servers were retired."""
    import os
    import signal
    import time

    import torch.distributed as dist

    from realscale.parallel.model_spec import spec_from_hf_config
    from realscale.publish.broadcast import BroadcastTransport
    from realscale.publish.control import ClientControl, ServerEndpoint
    from realscale.publish.reshard import ReshardTransport
    from realscale.publish.weight_world import WorldSpec
    from realscale.train.engine import EngineConfig, MegatronEngine

    pp = 2 if kind == "broadcast-pp2" else 1
    engine = MegatronEngine(EngineConfig(model_dir, tp=2 // pp, pp=pp, lr=None))
    rank0 = dist.get_rank() == 0
    killer = dist.get_rank() == (1 if pp > 1 else 0)
    control = ClientControl([ServerEndpoint(u, r) for u, r in endpoints]) if rank0 else None
    transport = ReshardTransport("gloo", timeout_s=120) if kind == "reshard" else BroadcastTransport("gloo", 1 << 16)
    transport.connect(engine, control)
    transport.send(engine, 1, control)
    perturb(engine, 1)

    def kill() -> None:
        os.killpg(victim_pgid, signal.SIGKILL)
        time.sleep(1.0)  # the kernel has closed its sockets

    if rank0 and kind == "reshard":
        member, send = transport.member, transport.member.send
        member.send = lambda buf: (kill(), send(buf))[1]  # after the world was agreed and joined
    elif killer and kind != "reshard":
        export = engine.export_hf_weights

        def export_then_kill(**kw: Any) -> Any:
            engine.export_hf_weights = export  # the resend exports untouched
            for i, bucket in enumerate(export(**kw)):
                if i == 1:
                    kill()
                yield bucket
        engine.export_hf_weights = export_then_kill
    transport.send(engine, 2, control)
    spec = spec_from_hf_config(engine.hf_config, itemsize=4)
    survivor = endpoints[:1]
    world = WorldSpec("127.0.0.1", 1, "check", "gloo", "d1t1p1", [r for _, r in survivor])
    held = server_check(engine, spec, world, survivor)
    out = None
    if rank0:
        out = {"held": held, "retired": [s.url for s in control.client.servers if s.retired]}
        transport.close()
        control.close()
    else:
        transport.close()
    return out


def broadcast_into_servers(model_dir: str, layouts: list[str], endpoints: list[tuple[str, int]],
                           steps: int = 2) -> list[dict]:
    """SGLang's protocol (``BroadcastTransport``; with pipeline stages its per-stage
    groups) from each trainer layout into ``endpoints``, ``steps`` updates (weights changed
    after the first), checked by :func:`server_check` after each. Returns this rank's
    records: bytes it sent itself, and on rank 0 what the servers hold."""
    import torch.distributed as dist

    from realscale.parallel.mesh import Strategy
    from realscale.parallel.model_spec import spec_from_hf_config
    from realscale.publish.broadcast import BroadcastTransport
    from realscale.publish.control import ClientControl, ServerEndpoint
    from realscale.publish.weight_world import WorldSpec
    from realscale.train.engine import EngineConfig, MegatronEngine

    rank, out, version = dist.get_rank(), [], 0
    for strategy in layouts:
        s = Strategy.parse(strategy)
        engine = MegatronEngine(EngineConfig(model_dir, tp=s.tp, pp=s.pp, lr=None))
        spec = spec_from_hf_config(engine.hf_config, itemsize=4)
        control = ClientControl([ServerEndpoint(u, r) for u, r in endpoints]) if rank == 0 else None
        transport = BroadcastTransport("gloo", bucket_bytes=1 << 16)
        transport.connect(engine, control)
        sender = transport.staged.sender if transport.staged is not None else transport.sender
        for step in range(steps):
            if step:
                perturb(engine, version)
            version += 1
            counted = _counting(sender)
            stats = transport.send(engine, version, control)
            out.append({"case": (strategy, step), "sent": counted(), "version": str(version), "bytes": stats.bytes,
                        "lower_bound": stats.lower_bound, "full": engine.hf_weight_bytes(),
                        "held": [h for i, ep in enumerate(endpoints)  # servers of any rank count, one at a time
                                 for h in (server_check(engine, spec, WorldSpec("127.0.0.1", 1, "check", "gloo",
                                                                                 "d1t1p1", [ep[1]]), [ep]) or [])
                                 ]})
        transport.close()
        if control is not None:
            control.close()
    return out


def _counting(sender: Any) -> Any:
    """Count the bytes ``sender`` (this rank's, or None) broadcasts from now on."""
    total = [0]
    if sender is not None:
        send = sender.broadcast_bucket

        def counted(bucket: Any, load_format: Any = None) -> int:
            n = send(bucket, load_format)
            total[0] += n
            return n
        sender.broadcast_bucket = counted
    return lambda: total[0]

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
                held = server_check(engine, transport.spec, transport.member.world, endpoints)
                out.append({"case": (strategy, dst, step), "sent": transport.sent_bytes, "version": str(version),
                            "bytes": stats.bytes, "lower_bound": stats.lower_bound,
                            "received": [transport.received.get(u) for u, _ in endpoints], "held": held})
            transport.close()
            if control is not None:
                control.close()
    return out

"""Workers of the colocated-generation tests (spawned trainer ranks import this module).

Each rank builds a real Megatron engine in a training layout and a
:class:`~realscale.serve.colocated.ColocatedGeneration` whose generation layout lives on
the same ranks, publishes, and reports a hash per tensor of its generation buffer. Ground
truth: the trainer's weights exported to full HF tensors (gathered over tp and down the
pipeline: not the resharder's path), converted to the spec's Megatron tensors and sliced
for each generation rank with ``pack_shard``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "publish"))
from weight_world_cases import perturb  # noqa: E402 - the weight world's way of changing every weight


def _expected(engine: Any, spec: Any, gen: Any, world: int) -> dict[int, dict[str, str]] | None:
    """Rank 0: each generation rank's tensor hashes from the exported weights (collective)."""
    import torch.distributed as dist

    from realscale.serve.weights import full_megatron_tensors, shard_hashes
    from realscale.parallel.mesh import Layout, Mesh

    named = [nt for bucket in engine.export_hf_weights() for nt in bucket]
    if dist.get_rank() != 0:
        return None
    full = full_megatron_tensors(named, spec, engine.arch)
    dst = Layout(Mesh(0, world), gen)
    return {g: shard_hashes(spec, dst, g, full) for g in range(world)}


def publish_cases(model_dir: str, cases: list[tuple[str, str, bool]], steps: int = 2) -> list[dict[str, Any]]:
    """For each (training strategy, generation strategy, release): publish ``steps``
    versions (the weights changed in between) and return, per step, every rank's hashes,
    rank 0's expected hashes and the bytes moved."""
    import torch.distributed as dist

    from realscale.config import load_config
    from realscale.serve.colocated import ColocatedGeneration
    from realscale.parallel.mesh import Strategy
    from realscale.train.engine import EngineConfig, MegatronEngine

    world = dist.get_world_size()
    out = []
    for train, gen, release in cases:
        s, g = Strategy.parse(train), Strategy.parse(gen)
        cfg = load_config(None, ["parallel.mode=colocated", f"parallel.dp={s.dp}", f"parallel.tp={s.tp}",
                                 f"parallel.pp={s.pp}", "rollout.max_staleness=0", f"generate.num_servers={g.dp}",
                                 f"generate.tp={g.tp}", "generate.max_running_requests=4",
                                 "generate.context_length=64", f"parallel.release_idle_memory={release}"])
        engine = MegatronEngine(EngineConfig(model_dir, tp=s.tp, pp=s.pp, lr=None))
        colocated = ColocatedGeneration(cfg, model_dir, engine)
        resident_after_init = colocated.worker.resident
        for step in range(steps):
            if step:
                perturb(engine, step)
            stats = colocated.publish(engine, step)
            hashes: list[Any] = [None] * world
            dist.all_gather_object(hashes, colocated.worker.weights.hashes())
            out.append({"case": (train, gen, release), "step": step, "hashes": hashes, "stats": stats,
                        "expected": _expected(engine, colocated.spec, g, world),
                        "resident_after_init": resident_after_init, "urls": colocated.urls})
        colocated.close()
    return out

"""Layout pairs and the per-rank worker shared by the resharding tests and benchmark."""

from __future__ import annotations

from realscale.parallel.mesh import Layout, Mesh, Strategy
from realscale.parallel.model_spec import ModelSpec, transformer_spec


def small_spec(tied: bool = False, qkv_bias: bool = True) -> ModelSpec:
    """A 4-layer model every tp in {1, 2, 4} and pp in {1, 2, 4} can shard."""
    return transformer_spec(hidden=16, n_layers=4, n_heads=8, n_kv_heads=4, ffn=24, vocab=100,
                            tie_embeddings=tied, qkv_bias=qkv_bias, itemsize=4, vocab_multiple=16)


def small_moe_spec() -> ModelSpec:
    """A 4-layer mixture of 4 experts (Qwen3-MoE-like) that tp in {1, 2} and ep in {1, 2, 4} can shard."""
    return transformer_spec(hidden=16, n_layers=4, n_heads=8, n_kv_heads=4, ffn=24, vocab=100, qkv_bias=False,
                            qk_norm=True, itemsize=4, vocab_multiple=16, num_experts=4, moe_ffn=8, moe_topk=2)


def lay(text: str, start: int, partition: tuple[int, ...] | None = None) -> Layout:
    s = Strategy.parse(text)
    return Layout(Mesh(start, s.world), s, partition)


def full_tensors(spec: ModelSpec, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def worker(cases: list[tuple[bool | str, Layout, Layout, int, int]]) -> list[dict]:
    """On every rank: run each case, compare with direct slicing, report bytes. A case's
    first item: whether the dense spec ties its embedding, or ``"moe"`` (:func:`small_moe_spec`)."""
    import torch
    import torch.distributed as dist

    from realscale.parallel.device import comm_device
    from realscale.parallel.reshard import lower_bound_elems, plan_reshard
    from realscale.parallel.reshard_exec import Resharder, pack_shard

    rank = dist.get_rank()
    out = []
    for tied, src, dst, gpus_per_node, bucket_bytes in cases:
        spec = small_moe_spec() if tied == "moe" else small_spec(bool(tied))
        full = full_tensors(spec)
        plan = plan_reshard(spec, src, dst, gpus_per_node=gpus_per_node)
        rs = Resharder(plan, bucket_bytes=bucket_bytes, max_inflight_bytes=4 * bucket_bytes)
        got, stats = rs.run(pack_shard(spec, src, rank, full), dtype=torch.float32)
        want = pack_shard(spec, dst, rank, full)
        same = (got is None and want is None) or (got is not None and want is not None and torch.equal(got, want))
        lb = lower_bound_elems(spec, src, dst).get(rank, 0) * 4
        # every buffer the resharder hands to a collective is where the device helper says
        on_comm = rs.device == comm_device(dist.get_backend()) and (got is None or got.device == rs.device)
        out.append({"case": f"{src} -> {dst}", "identical": same, "recv": stats.recv_bytes, "lower_bound": lb,
                    "plan_recv": plan.recv_bytes(rank), "on_comm_device": on_comm})
    return out

"""Per-rank worker of the batch-scatter tests: the scatter against today's path."""

from __future__ import annotations

from typing import Any


def synthetic_batch(num_seqs: int = 24, seed: int = 0, max_len: int = 40) -> Any:
    """A packed batch shaped like the actor's: tokens, loss mask, behaviour log-probs,
    advantages and versions, sequences of random lengths."""
    import torch

    from realscale.train.batch import PackedBatch

    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, max_len, (num_seqs,), generator=gen).tolist()
    seqs = [torch.randint(0, 1000, (n,), generator=gen) for n in lens]
    fields = {"loss_mask": [(torch.arange(n) >= 2).float() for n in lens],
              "behav_logprobs": [-torch.rand(n, generator=gen) for n in lens],
              "advantages": [torch.full((n,), float(torch.randn(1, generator=gen))) for n in lens],
              "versions": [torch.full((n,), 3.0) for n in lens]}
    return PackedBatch.from_sequences(seqs, fields)


def reference_shares(batch: Any, num_mini: int, dp: int, dp_rank: int) -> list[Any]:
    """Today's path, as main ran it: the whole batch on every rank, then this rank's
    token-balanced share of each mini-batch (the rule written out here once more)."""
    from realscale.data.packing import balanced_partition
    from realscale.train.actor import broadcast_batch, mini_batches

    whole = broadcast_batch(batch)
    out = []
    for part in mini_batches(whole, num_mini):
        assign = balanced_partition(part.seqlens().numpy(), dp) if dp > 1 else [0] * part.num_seqs
        out.append(part.select([i for i, b in enumerate(list(assign)) if b == dp_rank]))
    return out


def scatter_vs_broadcast(layouts: list[tuple[int, int]], num_mini: int, num_seqs: int) -> list[dict[str, Any]]:
    """On every rank, for each (tp, pp) layout: the scatter's shares against the
    reference, and the bytes moved."""
    from realscale.parallel.megatron_state import destroy_megatron

    out = []
    for tp, pp in layouts:
        out.append(_one_layout(tp, pp, num_mini, num_seqs))
        destroy_megatron()
    return out


def _one_layout(tp: int, pp: int, num_mini: int, num_seqs: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from realscale.config import AlgoConfig
    from realscale.train.batch_scatter import PLACEHOLDER_TOKEN, BatchScatter
    from realscale.parallel.megatron_state import Layout, init_megatron, rank_info
    from realscale.train.actor import split_for_dp, stage_needs
    from realscale.train.engine import micro_batch_plan

    init_megatron(Layout(tp=tp, pp=pp))
    r = rank_info()
    needs = stage_needs(AlgoConfig())
    batch = synthetic_batch(num_seqs) if dist.get_rank() == 0 else None
    split = split_for_dp(batch, num_mini, r.dp) if batch is not None else None
    mine, stats = BatchScatter(r, needs).scatter(split)
    ref = reference_shares(batch, num_mini, r.dp, r.dp_rank)
    keys = needs.keys(r.pp_rank, r.pp)
    problems = []
    for m, (got, want) in enumerate(zip(mine, ref)):
        if not torch.equal(got.cu_seqlens, want.cu_seqlens):
            problems.append(f"mini-batch {m}: cu_seqlens differ")
        if "input_ids" in keys and not torch.equal(got.input_ids, want.input_ids):
            problems.append(f"mini-batch {m}: input_ids differ")
        if "input_ids" not in keys and not bool((got.input_ids == PLACEHOLDER_TOKEN).all()):
            problems.append(f"mini-batch {m}: a stage that reads no tokens holds tokens")
        if set(got.fields) != set(keys) - {"input_ids", "cu_seqlens"}:
            problems.append(f"mini-batch {m}: fields {sorted(got.fields)} for keys {keys}")
        for k in got.fields:
            if got.fields[k].dtype != want.fields[k].dtype or not torch.equal(got.fields[k], want.fields[k]):
                problems.append(f"mini-batch {m}: field {k} differs")
        if micro_batch_plan(got, 40) != micro_batch_plan(want, 40):  # the engine's split
            problems.append(f"mini-batch {m}: micro-batches differ")
    need = sum((want.input_ids if k == "input_ids" else want.cu_seqlens if k == "cu_seqlens" else want.fields[k]).nbytes
               for want in ref for k in keys)
    return {"where": (r.dp_rank, r.pp_rank, r.tp_rank), "problems": problems, "count": len(mine),
            "bytes": stats.bytes, "header_bytes": stats.header_bytes, "bound": stats.lower_bound,
            "need": need if dist.get_rank() != 0 else 0, "batch_bytes": sum(t.nbytes for t in synthetic_batch(num_seqs).to_payload().values())}


def republish_orders(times: int) -> dict[str, Any]:
    """Two ranks (dp 2): while the driver "waits for its batch" it orders ``times``
    republishes, each a collective of both ranks (as a weight transport is); then the
    batch. Every rank's republish count and its share's sequences."""
    import types

    import torch
    import torch.distributed as dist

    from realscale.config import AlgoConfig
    from realscale.train.actor import split_for_dp, stage_needs
    from realscale.train.batch_scatter import BatchScatter

    rank = dist.get_rank()
    ranks = types.SimpleNamespace(dp=2, pp=1, tp=1, dp_rank=rank, pp_rank=0, tp_rank=0)
    scatter = BatchScatter(ranks, stage_needs(AlgoConfig()))
    done = []

    def republish() -> None:
        total = torch.tensor([rank + 1])
        dist.all_reduce(total)  # every rank takes part, or this hangs
        done.append(int(total))

    split = None
    if rank == 0:
        for _ in range(times):
            scatter.order_republish()
            republish()
        split = split_for_dp(synthetic_batch(8), 1, 2)
    mine, _ = scatter.scatter(split, republish=republish)
    return {"republished": done, "seqs": sum(b.num_seqs for b in mine)}

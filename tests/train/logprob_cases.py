"""Worker for the TP=2 log-prob tests (spawned ranks import this module by name).

Each rank takes its vocab shard of the full inputs the test built, runs the chunked
vocab-parallel functions over megatron's own TP group, and returns values and gradients;
the test compares them with the single-process reference on the full vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch


def _shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows ``rank*S:(rank+1)*S`` of ``x`` (the vocab dim first), as a fresh leaf."""
    s = x.shape[0] // world
    return x[rank * s:(rank + 1) * s].clone()


def _run_logits(case: dict[str, Any], rank: int, world: int, group: Any) -> dict[str, Any]:
    from realscale.train.logprobs import vocab_parallel_logprobs

    shard = _shard(case["logits"].t(), rank, world).t().contiguous().requires_grad_()
    lp, ent = vocab_parallel_logprobs(shard, case["targets"], temperature=case["T"], vocab_start=rank * shard.shape[1],
                                      true_vocab_size=case["V"], tp_group=group, chunk_tokens=case["chunk"],
                                      with_entropy=case["entropy"])
    loss = (lp * case["g_lp"]).sum() + ((ent * case["g_h"]).sum() if ent is not None else 0.0)
    loss.backward()
    return {"lp": lp.detach(), "ent": None if ent is None else ent.detach(), "grad": shard.grad}


def _run_hidden(case: dict[str, Any], rank: int, world: int, group: Any) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    from realscale.train.logprobs import logprobs_from_hidden

    hidden = case["hidden"].clone().requires_grad_()
    weight = _shard(case["weight"], rank, world).requires_grad_()
    # The documented recipe: identity forward, all-reduce of the partial grads backward.
    h = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    lp, ent = logprobs_from_hidden(h, weight, case["targets"], temperature=case["T"], vocab_start=rank * weight.shape[0],
                                   true_vocab_size=case["V"], tp_group=group, chunk_tokens=case["chunk"],
                                   with_entropy=case["entropy"])
    loss = (lp * case["g_lp"]).sum() + ((ent * case["g_h"]).sum() if ent is not None else 0.0)
    loss.backward()
    return {"lp": lp.detach(), "ent": None if ent is None else ent.detach(), "grad": weight.grad,
            "grad_hidden": hidden.grad}


def _run_megatron_ce(case: dict[str, Any], rank: int, world: int, group: Any) -> dict[str, Any]:
    """Megatron's own vocab-parallel cross-entropy on the same shard: an independent implementation."""
    from megatron.core import tensor_parallel

    shard = _shard(case["logits"].t(), rank, world).t().contiguous().requires_grad_()
    loss = tensor_parallel.vocab_parallel_cross_entropy(shard.unsqueeze(1), case["targets"].unsqueeze(1)).squeeze(1)
    (-(loss * case["g_lp"]).sum()).backward()  # d(logprob) = -d(cross-entropy)
    return {"lp": -loss.detach(), "ent": None, "grad": shard.grad}


RUNNERS = {"logits": _run_logits, "hidden": _run_hidden, "megatron_ce": _run_megatron_ce}


def run_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All cases on this rank, in order, over megatron's TP group (tp = world size)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from realscale.parallel.megatron_state import Layout, destroy_megatron, init_megatron

    world = dist.get_world_size()
    init_megatron(Layout(tp=world))
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        return [RUNNERS[c["kind"]](c, rank, world, group) for c in cases]
    finally:
        destroy_megatron()

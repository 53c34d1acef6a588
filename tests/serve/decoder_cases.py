"""Workers for the decoder tests (spawned ranks import this module)."""

from __future__ import annotations

import torch


def decoder_logits(model: str, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits ``[B, T - prefill + 1, V]`` of this rank's :class:`ShardedDecoder` (tp = the
    default group's size, or 1 outside one): a prefill of ``prefill`` tokens, then one
    decode step per remaining token, with a slot move half-way."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from realscale.serve.decoder import ShardedDecoder, TPComm
    from realscale.serve.weights import RankWeights, read_hf_config
    from realscale.models.tiny import resolve_model_path

    path = resolve_model_path(model)
    tp, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    weights = RankWeights.allocate(read_hf_config(path), tp, rank, torch.float32, torch.device("cpu"))
    weights.load_dir(path)
    dec = ShardedDecoder(weights, lambda: AutoConfig.from_pretrained(path), TPComm(dist.group.WORLD if tp > 1 else None),
                         max_slots=ids.shape[0] + 1, max_len=ids.shape[1] + 4)
    bsz, total = ids.shape
    # rows live in slots 1..B first, so the move below exercises the cache copy
    out = [dec.forward(1, ids[:, :prefill], torch.zeros(bsz, dtype=torch.long), torch.full((bsz,), prefill - 1))]
    for t in range(prefill, total):
        if t == prefill + 1:
            for b in range(bsz):  # slots 1..B -> 0..B-1, as the engine moves a request
                dec.move_slot(b + 1, b, t)
        slot0 = 1 if t <= prefill else 0
        out.append(dec.forward(slot0, ids[:, t:t + 1], torch.full((bsz,), t), torch.zeros(bsz, dtype=torch.long)))
    return torch.stack(out, dim=1)


def all_families(models: list[str], ids: torch.Tensor, prefill: int) -> dict[str, torch.Tensor]:
    """:func:`decoder_logits` for each model (one spawn serves them all)."""
    return {m: decoder_logits(m, ids, prefill) for m in models}


def rank_info(worker, tag: str) -> dict:
    """A ``call_all("decoder_cases:rank_info", tag)`` target: what each rank holds."""
    import os

    return {"tag": tag, "rank": worker.tp_rank, "pid": os.getpid(), "numel": worker.weights.flat.numel()}

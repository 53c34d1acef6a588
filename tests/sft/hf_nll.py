"""Masked next-token NLL under Hugging Face: an independent check of what SFT wrote."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


def hf_masked_nll(model_dir: str, encode: Callable[[Any, Any], tuple[list[int], list[float]]],
                  items: Iterable[Any]) -> float:
    """Token-mean NLL of the masked tokens of ``encode(tokenizer, item)`` for each item."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0.0
    for item in items:
        ids, mask = encode(tok, item)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
        lp = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        m = torch.tensor(mask[1:])
        total += float(-(lp * m).sum())
        count += float(m.sum())
    return total / count

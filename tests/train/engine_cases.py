"""Worker functions for the engine tests (spawned ranks import this module)."""

from __future__ import annotations

from typing import Any

import torch

LENGTHS = (11, 7, 16)


def sequences(vocab: int, lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def hf_logits(model_dir: str, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(s[None]).logits[0].float() for s in seqs]


def logits_diff(model_dir: str, tp: int, pp: int, sp: bool = False, budget: int = 24) -> dict[str, Any]:
    """Max |megatron - HF| over packed sequences (budget forces several micro-batches)."""
    from realscale.train.batch import PackedBatch
    from realscale.train.engine import EngineConfig, MegatronEngine

    eng = MegatronEngine(EngineConfig(model_path=model_dir, tp=tp, pp=pp, sequence_parallel=sp, lr=None,
                                      max_tokens_per_micro_batch=budget))
    seqs = sequences(eng.arch.vocab_size)
    batch = PackedBatch.from_sequences(seqs)
    logits = eng.full_logits(batch)
    if logits is None:
        return {"diff": None}
    ref = torch.cat(hf_logits(model_dir, seqs))
    return {"diff": float((logits - ref).abs().max()), "scale": float(ref.abs().max())}


def roundtrip(model_dir: str, tp: int, pp: int, out_dir: str) -> dict[str, Any]:
    """HF -> megatron (tp, pp) -> HF; rank 0 writes ``out_dir``."""
    from realscale.train.engine import EngineConfig, MegatronEngine

    eng = MegatronEngine(EngineConfig(model_path=model_dir, tp=tp, pp=pp, lr=None))
    eng.save_hf(out_dir)
    return {"ok": True}

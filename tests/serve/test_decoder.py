"""The tensor-parallel decoder: tp=1 equals the HF model, tp=2 (two gloo ranks) equals tp=1.

Measured bounds (fp32, tiny models with N(0, 1) embeddings, so logits reach ~80): tp=1 vs
HF at most 2e-5 (relative ~3e-7: float rounding of a fused vs split matmul); tp=2 vs
tp=1 at most 2e-5; both tp=2 ranks bit-identical.
"""

from __future__ import annotations

import pytest
import torch

import decoder_cases as cases
from realscale.models.tiny import FAMILIES, resolve_model_path
from realscale.parallel.spawn import run_distributed

MODELS = [f"tiny-{f.replace('_', '-')}" for f in FAMILIES]  # tiny-qwen3-moe: every layer a mixture of experts


def _ids() -> torch.Tensor:
    return torch.randint(0, 260, (3, 14), generator=torch.Generator().manual_seed(0))


def _hf_logits(model: str, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(model)).eval()
    with torch.no_grad():
        return hf(ids).logits[:, prefill - 1:].float()


@pytest.mark.parametrize("model", MODELS)
def test_tp1_equals_hf(model: str) -> None:
    ids = _ids()
    got = cases.decoder_logits(model, ids, prefill=6)
    ref = _hf_logits(model, ids, 6)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 5e-5 * max(1.0, ref.abs().max().item() / 10)


@pytest.mark.multiproc
def test_tp2_equals_tp1() -> None:
    ids = _ids()
    ranks = run_distributed(cases.all_families, 2, MODELS, ids, 6, timeout=300)
    for model in MODELS:
        one = cases.decoder_logits(model, ids, prefill=6)
        assert torch.equal(ranks[0][model], ranks[1][model]), model  # every rank computes the same logits
        assert (ranks[0][model] - one).abs().max().item() < 1e-4, model


def test_refuses_what_it_cannot_serve() -> None:
    from realscale.serve.weights import UnsupportedModelError, model_spec, read_hf_config

    cfg = read_hf_config(resolve_model_path("tiny-qwen2"))  # 4 heads, 2 kv heads
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        model_spec({**cfg, "use_sliding_window": True}, 1, torch.float32)
    with pytest.raises(UnsupportedModelError, match="tp=4 does not divide the 2 key/value"):
        model_spec(cfg, 4, torch.float32)
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        model_spec({**cfg, "model_type": "gpt2"}, 1, torch.float32)

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


@pytest.mark.parametrize("family,cls", [("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("llama", "Llama")])
def test_default_rope_is_the_families_own(family: str, cls: str) -> None:
    """Our default RoPE (what the server runs without importing the family's module,
    realscale/serve/decoder.py) gives bit-identical cos/sin and rotated q/k to the HF
    family's ``<Family>RotaryEmbedding`` and ``apply_rotary_pos_emb`` (modeling_qwen2.py,
    modeling_qwen3.py, modeling_llama.py of transformers 5.19), theta and head dim off their
    defaults."""
    import importlib

    from transformers import AutoConfig

    from realscale.serve.decoder import DefaultRotary, apply_rotary

    config = AutoConfig.for_model(family, hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                                  rope_theta=12345.0, max_position_embeddings=512)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    theirs = getattr(module, f"{cls}RotaryEmbedding")(config=config)
    ours = DefaultRotary(32, 12345.0)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 500, (2, 7), generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(2, 7, 96, dtype=dtype)
        (c1, s1), (c2, s2) = ours(x, pos), theirs(x, pos)
        assert c1.dtype == c2.dtype == dtype and torch.equal(c1, c2) and torch.equal(s1, s2)
        q, k = torch.randn(2, 3, 7, 32, generator=g).to(dtype), torch.randn(2, 1, 7, 32, generator=g).to(dtype)
        for a, b in zip(apply_rotary(q, k, c1, s1), module.apply_rotary_pos_emb(q, k, c2, s2)):
            assert torch.equal(a, b)


def test_scaled_rope_uses_the_family_module(tmp_path) -> None:
    """A model with ``rope_scaling`` (linear, factor 2) is decoded with the HF family's own
    rotary class (the config object is built only then), and still equals HF's logits."""
    import json
    import shutil

    from realscale.serve.decoder import DefaultRotary, rope_for
    from realscale.serve.weights import RankWeights, read_hf_config

    src = resolve_model_path("tiny-qwen2")
    path = str(tmp_path / "scaled")
    shutil.copytree(src, path)
    cfg = read_hf_config(path)
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    with open(f"{path}/config.json", "w", encoding="utf-8") as fh:
        json.dump(cfg, fh)
    weights = RankWeights.allocate(read_hf_config(path), 1, 0, torch.float32, torch.device("cpu"))
    asked = []
    rotary, _ = rope_for(weights, lambda: asked.append(1) or __import__("transformers").AutoConfig.from_pretrained(path),
                         torch.device("cpu"))
    assert asked and not isinstance(rotary, DefaultRotary)
    plain = RankWeights.allocate(read_hf_config(src), 1, 0, torch.float32, torch.device("cpu"))
    assert isinstance(rope_for(plain, lambda: pytest.fail("config built for the default RoPE"),
                               torch.device("cpu"))[0], DefaultRotary)
    ids = _ids()
    got = cases.decoder_logits(path, ids, prefill=6)
    ref = _hf_logits(path, ids, 6)
    assert (got - ref).abs().max().item() < 5e-5 * max(1.0, ref.abs().max().item() / 10)
    assert (got - cases.decoder_logits(src, ids, prefill=6)).abs().max().item() > 1e-3  # the scaling took effect

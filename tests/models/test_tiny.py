"""Tiny models: every family builds, loads offline with transformers, and round-trips text."""

from __future__ import annotations

import json
import os

import pytest

from realscale.models import tiny


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_build_loads_with_transformers(tmp_path, family: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny.build_tiny_model(str(tmp_path / family), family=family)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == family
    assert model.config.vocab_size % 8 == 0 and model.config.vocab_size >= len(tok)
    assert model.config.tie_word_embeddings == (family != "llama")
    text = "Q: 12 + 30 = ?\nA:\t42 {x} ~é"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) == len(text) + 1  # one token per ASCII char; é is two UTF-8 bytes
    assert tok.eos_token == tiny.EOS_TOKEN and tok.pad_token_id == tok.eos_token_id == model.config.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") in tok(chat)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()


def test_seed_determines_weights(tmp_path) -> None:
    from safetensors.torch import load_file

    a = load_file(os.path.join(tiny.build_tiny_model(str(tmp_path / "a"), seed=3), "model.safetensors"))
    b = load_file(os.path.join(tiny.build_tiny_model(str(tmp_path / "b"), seed=3), "model.safetensors"))
    c = load_file(os.path.join(tiny.build_tiny_model(str(tmp_path / "c"), seed=4), "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)


def test_resolve_builds_once_into_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("REALSCALE_CACHE", str(tmp_path))
    path = tiny.resolve_model_path("tiny-qwen3")
    assert path == os.path.join(str(tmp_path), "models", f"tiny-qwen3.v{tiny._BUILD_FORMAT}")
    with open(os.path.join(path, "config.json")) as fh:
        assert json.load(fh)["model_type"] == "qwen3"
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert tiny.resolve_model_path("tiny-qwen3") == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime  # cached, not rebuilt
    assert [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".")] == []  # no temp dirs left
    assert tiny.resolve_model_path(path) == path  # a directory passes through


def test_resolve_rejects_unknown(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither an existing directory nor a built-in"):
        tiny.resolve_model_path("tiny-gpt5")
    with pytest.raises(ValueError, match="no config.json"):
        tiny.resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model family"):
        tiny.build_tiny_model(str(tmp_path / "x"), family="gpt2")


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_init_is_the_hf_familys(tmp_path, family: str) -> None:
    """Linear and embedding weights ~ normal(0, initializer_range), norms 1 (transformers' _init_weights)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = tiny.build_tiny_model(str(tmp_path / family), family=family)
    std = AutoConfig.from_pretrained(path).initializer_range
    for name, w in load_file(os.path.join(path, "model.safetensors")).items():
        if name.endswith("norm.weight"):
            assert (w == 1).all(), name
        elif w.dim() == 2:
            assert abs(float(w.std()) - std) < 0.2 * std and abs(float(w.mean())) < 0.2 * std, name


@pytest.mark.parametrize("name", ["tiny-qwen2", "small-qwen2", "tiny-qwen3", "tiny-llama"])
def test_untrained_model_samples_a_real_distribution(tmp_path, monkeypatch, name: str) -> None:
    """At temperature 1 an untrained built-in model spreads its probability over the
    vocabulary and the embedded engine samples many different tokens (the std-1 embedding of
    an earlier build made tied Qwen2 repeat its last token with log-prob 0)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from realscale.serve.engine import Request, SamplingOptions
    from realscale.serve.server import EmbeddedServer

    monkeypatch.setenv("REALSCALE_CACHE", str(tmp_path))
    path = tiny.resolve_model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("What is 12+30? Answer:")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    entropy = float(-(logp.exp() * logp).sum())
    assert entropy > 0.5 * math.log(len(tok)), f"{name}: next-token entropy {entropy:.3f} nats"
    server = EmbeddedServer(path, seed=0, context_length=128)  # the serving path: decoder over Megatron-layout shards
    try:
        req = Request("r", ids, SamplingOptions(max_new_tokens=32, temperature=1.0, ignore_eos=True),
                      return_logprob=True)
        out = server.engine.submit(req).result(timeout=120)
    finally:
        server.close()
    assert len(set(out.output_ids)) >= 8, out.output_ids
    assert max(out.logprobs) < -0.5  # no token is sampled with (near) certainty

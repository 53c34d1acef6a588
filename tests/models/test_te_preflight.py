"""Defect 5 of the GPU-path issue: no silent fallback to the dense local attention on
GPUs, and a Transformer Engine or kernel that is installed but broken is said, not
mistaken for "absent"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from realscale import kernels
from realscale.errors import UserError
from realscale.models import megatron_gpt
from realscale.models.megatron_gpt import DENSE_ATTENTION_TOKENS, check_attention_path, te_status


def test_long_packed_micro_batches_on_gpus_need_te() -> None:
    with pytest.raises(UserError) as err:
        check_attention_path(32768, on_gpu=True, use_te=False)
    msg = str(err.value)
    assert "\n" not in msg and "train.max_tokens_per_micro_batch=32768" in msg and "not been validated on GPUs" in msg
    assert "transformer_engine[pytorch]" in msg and f"<={DENSE_ATTENTION_TOKENS}" in msg
    # within the bound, with TE, or on CPU: nothing to refuse
    check_attention_path(DENSE_ATTENTION_TOKENS, on_gpu=True, use_te=False)
    check_attention_path(32768, on_gpu=True, use_te=True)
    check_attention_path(32768, on_gpu=False, use_te=False)


def test_te_that_does_not_import_is_reported_as_broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TE built against another torch fails at import with an undefined symbol."""
    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pytorch" / "__init__.py").write_text(
        "raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c105ErrorC2E')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    te_status.cache_clear()
    try:
        ok, why = te_status()
        assert not ok and "does not import" in why and "undefined symbol" in why and "rebuild it against torch" in why
        with pytest.raises(UserError, match="does not import"):
            check_attention_path(16384, on_gpu=True, use_te=megatron_gpt.te_available())
    finally:
        te_status.cache_clear()
        for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
            del sys.modules[name]


def test_kernel_built_against_another_torch_is_said(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import importlib

    real = importlib.import_module

    def fake(name: str, *a, **k):
        if name == "realscale._kernels.gae":
            raise ImportError("gae.so: undefined symbol: _ZN2at4_ops")
        if name == "realscale._kernels.nosuch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    kernels._imported.cache_clear()
    kernels._import.cache_clear()
    try:
        assert kernels._imported("nosuch") == (None, "not built")
        module, why = kernels._imported("gae")
        assert module is None and "does not import" in why and "undefined symbol" in why
        assert any("kernel gae built but does not import" in r.getMessage() for r in caplog.records)
        assert kernels.status()["gae"] == why
    finally:
        kernels._imported.cache_clear()
        kernels._import.cache_clear()


def test_train_preflight_refuses_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`realscale train` on a GPU host (here: said to be one) with a 7B model, 32k-token
    micro-batches and no Transformer Engine: one line, before any process starts."""
    import json

    from realscale.commands.train import preflight
    from realscale.config import load_config

    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
        "num_key_value_heads": 4, "num_hidden_layers": 28, "intermediate_size": 18944, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}))
    cfg = load_config(None, [f"model.path={model}", "train.max_tokens_per_micro_batch=32768", "launch.backend=local",
                             "parallel.backend=gloo", "data.source=task:arith"])
    monkeypatch.setattr("realscale.parallel.device.cuda_usable", lambda: True)
    monkeypatch.setattr(megatron_gpt, "te_available", lambda: False)
    with pytest.raises(UserError, match="needs Transformer Engine"):
        preflight(cfg)

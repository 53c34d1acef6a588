"""Model families: how an HF ``config.json`` becomes a megatron-core GPT model.

A family is one small file (``qwen2.py``, ``qwen3.py``, ``llama.py``) that registers a
:class:`Family`: which HF ``model_type`` values it serves and what differs from the
common decoder (QKV bias, q/k-norm, mixture-of-experts MLPs). Everything the families share — GQA, RoPE (theta
and scaling), RMSNorm, SwiGLU, tied or untied embeddings, vocabulary padding for tensor
parallelism — lives here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from realscale.models import llama, qwen2, qwen3, qwen3_moe  # noqa: F401 - each registers its family
from realscale.models.registry import _REGISTRY, Family, register  # noqa: F401 - Family and register are the families' API


def family_of(model_type: str) -> Family:
    if model_type not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"model_type '{model_type}' is not supported; known families: {known}")
    return _REGISTRY[model_type]


@dataclass(frozen=True)
class MoEArch:
    """The experts of a mixture-of-experts decoder (every layer sparse).

    Routing as Qwen3-MoE's (transformers ``Qwen3MoeSparseMoeBlock``): softmax over all
    experts' router logits, the ``topk`` largest, renormalised to sum 1 when
    ``norm_topk_prob``. Megatron's router gives the same weights with
    ``moe_router_pre_softmax=False`` (softmax over the top-k logits) when renormalised, and
    ``True`` (softmax first, no renormalisation) otherwise."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # each expert's intermediate size
    norm_topk_prob: bool
    aux_loss_coef: float  # the model's own load-balancing coefficient (router_aux_loss_coef)


@dataclass(frozen=True)
class ModelArch:
    """The numbers of a decoder, read from an HF config (any supported family)."""

    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_embeddings: bool
    max_position_embeddings: int
    moe: MoEArch | None = None

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def padded_vocab(self, tp: int, multiple: int = 128) -> int:
        """Megatron shards the vocabulary evenly over TP; we pad to a multiple of
        ``lcm(multiple, tp)``, which for every tp dividing 128 is the same size whatever
        the tp (``realscale.parallel.model_spec.pad_vocab``): the trainer's and every
        generation server's full embedding agree, so the resharder moves rows between any
        two tp degrees, and checkpoints keep their shape across layouts. Padded rows are
        never sampled: log-probs mask them, export strips them."""

        unit = math.lcm(multiple, tp)
        return (self.vocab_size + unit - 1) // unit * unit


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 nests RoPE settings in ``rope_parameters``; older configs use
    # ``rope_theta`` + ``rope_scaling``.
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or ({k: v for k, v in params.items() if k != "rope_theta"} or None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def moe_from_hf(hf: dict[str, Any]) -> MoEArch:
    """The experts of a Qwen3-MoE config; refuse what is not one MoE block per layer."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes num_local_experts
    if not experts:
        raise ValueError("a MoE config needs num_experts (or num_local_experts)")
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise ValueError("dense layers among the MoE layers (decoder_sparse_step != 1 or mlp_only_layers) "
                         "are not supported: every layer must be a MoE layer")
    if hf.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts are not supported")
    topk = int(hf["num_experts_per_tok"])
    if not 1 <= topk <= int(experts):
        raise ValueError(f"num_experts_per_tok={topk} must be in [1, num_experts={experts}]")
    return MoEArch(num_experts=int(experts), topk=topk, ffn_hidden_size=int(hf["moe_intermediate_size"]),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))


def arch_from_hf(hf: dict[str, Any]) -> ModelArch:
    """Read an HF config dict; refuse what megatron's GPT model cannot represent."""
    family = family_of(str(hf.get("model_type", "")))
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = _rope(hf)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act '{act}' is not supported (SwiGLU with silu only)")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    if hf.get("mlp_bias") or (hf.get("attention_bias") and not family.qkv_bias):
        raise ValueError(f"{family.name}: linear biases other than the QKV bias are not supported")
    return ModelArch(
        family=family, vocab_size=int(hf["vocab_size"]), hidden_size=hidden, num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads), ffn_hidden_size=int(hf["intermediate_size"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        moe=moe_from_hf(hf) if family.moe else None,
    )


def load_arch(model_dir: str) -> ModelArch:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model_dir}: no config.json (expected an HF model directory)")
    with open(path, encoding="utf-8") as fh:
        return arch_from_hf(json.load(fh))


def rope_kwargs(arch: ModelArch) -> dict[str, Any]:
    """GPTModel keyword arguments for the family's RoPE."""
    kwargs: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": int(arch.rope_theta),
                              "rotary_percent": 1.0}
    if arch.rope_theta != int(arch.rope_theta):
        raise ValueError(f"rope_theta {arch.rope_theta} is not an integer (megatron takes an int base)")
    s = arch.rope_scaling
    if not s:
        return kwargs
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        kwargs["seq_len_interpolation_factor"] = float(s["factor"])
    elif kind == "llama3":
        # megatron's llama3 scaling fixes low/high frequency factors 1/4 and an original
        # context of 8192 (Llama 3.1's values); other values would silently differ.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in fixed.items():
            if float(s.get(key, want)) != want:
                raise ValueError(f"rope_scaling.{key}={s[key]} is not supported (megatron assumes {want})")
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(s["factor"]))
    else:
        raise ValueError(f"rope_scaling type '{kind}' is not supported (default, linear, llama3)")
    return kwargs

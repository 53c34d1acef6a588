"""The registry of model families: each family module (``qwen2.py``, ``qwen3.py``,
``qwen3_moe.py``, ``llama.py``) registers its :class:`Family` here; :mod:`realscale.models.family` looks them up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_REGISTRY: dict[str, "Family"] = {}


@dataclass(frozen=True)
class Family:
    """What distinguishes one decoder family from the common Llama-style decoder."""

    name: str
    model_types: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False  # every layer's MLP is a mixture of experts (family.MoEArch holds the numbers)
    extra: dict[str, Any] = field(default_factory=dict)


def register(family: Family) -> Family:
    for model_type in family.model_types:
        _REGISTRY[model_type] = family
    return family

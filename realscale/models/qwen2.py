"""Qwen2 / Qwen2.5: the common decoder with a bias on the fused QKV projection."""

from realscale.models.registry import Family, register

QWEN2 = register(Family(name="qwen2", model_types=("qwen2",), qkv_bias=True))

"""Qwen3: no QKV bias, RMSNorm on queries and keys per head (q/k-norm), explicit head_dim."""

from realscale.models.registry import Family, register

QWEN3 = register(Family(name="qwen3", model_types=("qwen3",), qk_norm=True))

"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k-norm, no QKV bias)
with every layer's MLP a mixture of SwiGLU experts behind a softmax top-k router, and no
shared expert. The numbers live in :class:`realscale.models.family.MoEArch`."""

from realscale.models.registry import Family, register

QWEN3_MOE = register(Family(name="qwen3_moe", model_types=("qwen3_moe",), qk_norm=True, moe=True))

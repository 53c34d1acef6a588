"""RL math as pure tensor functions: advantages, GAE, the (decoupled) PPO loss, the clipped
value loss, KL, filtering.

Everything here works on *packed* tensors: the tokens of many sequences concatenated
into one 1-D tensor, with ``cu_seqlens`` (int64, B+1 offsets) marking where each
sequence starts. Nothing here imports Megatron or touches a process group; the trainer
passes a global ``normalizer`` so that per-micro-batch losses add up to the exact mean
of the whole batch.
"""

from realscale.algo.advantages import (batch_normalized_advantages, broadcast_to_tokens, grpo_advantages,
                                       loo_advantages, masked_moments, normalize_by_moments)
from realscale.algo.filtering import FilterResult, dynamic_sampling_filter
from realscale.algo.gae import gae, gae_reference, gae_torch
from realscale.algo.kl import kl_penalty, masked_kl_sum
from realscale.algo.losses import loss_kwargs_from_config, loss_normalizer, ppo_loss
from realscale.algo.value import value_loss

__all__ = [
    "FilterResult",
    "batch_normalized_advantages",
    "broadcast_to_tokens",
    "dynamic_sampling_filter",
    "gae",
    "gae_reference",
    "gae_torch",
    "grpo_advantages",
    "kl_penalty",
    "loo_advantages",
    "loss_kwargs_from_config",
    "loss_normalizer",
    "masked_kl_sum",
    "masked_moments",
    "normalize_by_moments",
    "ppo_loss",
    "value_loss",
]

"""The critic of PPO with GAE (``algo.adv_estimator: gae``).

The value model is the policy's architecture with a scalar head: a megatron-core GPT on
the actor's ranks and layout (same tp/pp/dp groups: it is built with ``shared_layout``),
initialised from the policy's starting weights, the head at zero (every value starts at
0), with its own distributed optimizer (``optim`` settings, ``critic.lr``).

Per RL step, on each data-parallel share of each mini-batch (before any update):

1. **values** — ``V_t`` for every token ``t``, read from the hidden state *before* ``t``
   (the state in which the policy chose token ``t``), aligned like the log-probs;
2. **GAE** — token rewards are 0 except the sequence reward on the last trained token;
   :func:`realscale.algo.gae.gae` (the C++ kernel on packed sequences) with
   ``algo.gamma`` / ``algo.lam`` over the loss-masked tokens only, so tool outputs of a
   multi-turn episode are skipped, gives advantages (what the actor trains on) and
   returns (what the critic regresses to);
3. **update** — after the actor's update, one optimizer step of the clipped value loss
   (:func:`realscale.algo.value.value_loss`, ``critic.value_clip``) per mini-batch.

Sequences never span shares, so per-share GAE is exact: one rank equals N ranks.

Tensor parallelism: the head is replicated on every TP rank and reads the full final
hidden state there, so each TP rank computes the same values and the same gradients (no
TP reduction, unlike the vocabulary-parallel output layer); under sequence parallelism
the hidden state is gathered first and its gradient split back.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from realscale.algo.gae import gae
from realscale.algo.value import value_loss
from realscale.train.batch import PackedBatch
from realscale.train.engine import EngineConfig, LossFn, MegatronEngine

if TYPE_CHECKING:
    from realscale.config import AlgoConfig, Config, CriticConfig


def critic_engine_config(cfg: "Config", model_dir: str) -> EngineConfig:
    """The actor's engine settings with the critic's learning rate."""
    ec = EngineConfig.from_config(cfg, model_dir)
    # the critic routes its own tokens: the rollouts' routing is the policy's
    return dataclasses.replace(ec, lr=cfg.critic.lr or cfg.optim.lr, routing_replay=False)


class CriticEngine(MegatronEngine):
    """A value model: the trunk of ``ec.model_path`` plus a zero-initialised scalar head."""

    def __init__(self, ec: EngineConfig, *, shared_layout: bool = True) -> None:
        super().__init__(dataclasses.replace(ec, lr=None), shared_layout=shared_layout)
        self.ec = ec
        if self.ranks.is_last_stage:
            head = torch.nn.Linear(self.arch.hidden_size, 1, dtype=self.config.params_dtype)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            self.model.value_head = head.to(self.device)
        if ec.lr is not None:
            self._build_optimizer()

    def _token_values(self, model: Any, hidden: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        """``V_t`` for every token of the micro-batch (0 at each sequence's first token)."""
        from megatron.core import tensor_parallel

        if self.ec.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        gpt = model.module if hasattr(model, "module") else model
        n = mb.num_tokens
        values = gpt.value_head(self._token_states(hidden[:, 0], mb)).squeeze(-1).float()  # j: the state after token j
        keep = torch.ones(n, dtype=values.dtype, device=values.device)
        keep[mb.cu_seqlens[:-1].to(values.device)] = 0.0  # a first token has no state before it
        return torch.roll(values, 1) * keep

    def _trained_outputs(self, model: Any, hidden: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        return self._token_values(model, hidden, mb)

    def values(self, batch: PackedBatch) -> torch.Tensor:
        """Per-token values of ``batch`` (no gradient), on every rank of this replica."""
        return self.forward_tokens(batch, lambda m, h, mb: {"values": self._token_values(m, h, mb)},
                                   ["values"])["values"]


def token_rewards(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, rewards: list[float]) -> torch.Tensor:
    """Per-token rewards: each sequence's reward on its last trained token, 0 elsewhere
    (a sequence with no trained token carries none)."""
    out = torch.zeros(loss_mask.numel(), dtype=torch.float32)
    cu = cu_seqlens.tolist()
    for i, r in enumerate(rewards):
        trained = torch.nonzero(loss_mask[cu[i]:cu[i + 1]]).flatten()
        if trained.numel():
            out[cu[i] + int(trained[-1])] = r
    return out


def gae_advantages(critic: CriticEngine, share: PackedBatch, algo: "AlgoConfig") -> None:
    """Add ``values``, ``advantages`` and ``returns`` to ``share`` (GAE over its trained tokens)."""

    f = share.fields
    f["values"] = critic.values(share)
    f["advantages"], f["returns"] = gae(f["rewards"], f["values"], share.cu_seqlens, algo.gamma, algo.lam,
                                        mask=f["loss_mask"])


def value_loss_fn(critic_cfg: "CriticConfig") -> LossFn:
    """The clipped value loss as the engine's loss function."""

    def loss(values: torch.Tensor, mb: PackedBatch, normalizer: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        f = mb.fields
        return value_loss(values, f["values"].to(values.device), f["returns"].to(values.device),
                          f["loss_mask"].to(values.device), clip=critic_cfg.value_clip, normalizer=normalizer)
    return loss


def update_critic(critic: CriticEngine, shares: list[PackedBatch], critic_cfg: "CriticConfig") -> dict[str, float]:
    """One optimizer step of the value loss per mini-batch share; the last step's statistics."""
    loss_fn = value_loss_fn(critic_cfg)
    stats: dict[str, float] = {}
    for share in shares:
        stats = critic.train_step(share, loss_fn)
    return {f"critic/{k}": v for k, v in stats.items()}

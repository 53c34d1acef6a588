"""The actor's side of one RL step: rollout groups -> packed batch -> PPO update.

- :func:`groups_to_batch`: accepted groups become one packed batch with per-token loss
  mask, behaviour log-probs, advantages (GRPO / leave-one-out, from ``algo``) and the
  policy version of every token, plus rollout statistics.
- :func:`update_policy`: the decoupled PPO update of DESIGN.md over ``train.mini_batches``
  mini-batches; each data-parallel rank trains its token-balanced share; proximal
  log-probs come from the policy before the first update.

The loss arguments come from :func:`realscale.algo.losses.loss_kwargs_from_config`, the
one mapping from ``algo`` knobs to :func:`~realscale.algo.losses.ppo_loss`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from realscale.train.batch import PackedBatch

if TYPE_CHECKING:
    from realscale.config import AlgoConfig, Config
    from realscale.rollout.types import Group
    from realscale.train.engine import LossFn, MegatronEngine, NormalizerFn


def group_advantages(rewards: torch.Tensor, cu_groups: torch.Tensor, algo: "AlgoConfig") -> torch.Tensor:
    """One advantage per trajectory from its group's rewards."""
    from realscale.algo.advantages import grpo_advantages, loo_advantages

    if algo.adv_estimator == "loo":
        return loo_advantages(rewards, cu_groups=cu_groups)
    if algo.adv_estimator == "grpo":
        return grpo_advantages(rewards, cu_groups=cu_groups, std_norm=algo.group_std_norm)
    raise ValueError(f"algo.adv_estimator={algo.adv_estimator!r} needs a critic, which this loop does not train")


def groups_to_batch(groups: list["Group"], algo: "AlgoConfig") -> tuple[PackedBatch, dict[str, float]]:
    """Accepted groups -> one packed batch with per-token fields, and rollout stats."""
    trajs = [t for g in groups for t in g]
    sizes = torch.tensor([len(g) for g in groups])
    cu_groups = torch.zeros(len(groups) + 1, dtype=torch.long)
    cu_groups[1:] = torch.cumsum(sizes, 0)
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    adv = group_advantages(rewards, cu_groups, algo)
    seqs, mask, behav, advs, versions = [], [], [], [], []
    for t, a in zip(trajs, adv.tolist()):
        n_p, n_o = len(t.prompt_ids), len(t.output_ids)
        seqs.append(torch.tensor(t.prompt_ids + t.output_ids, dtype=torch.long))
        mask.append(torch.tensor([0.0] * n_p + [float(m) for m in t.loss_mask]))
        behav.append(torch.tensor([0.0] * n_p + list(t.output_logprobs), dtype=torch.float32))
        advs.append(torch.full((n_p + n_o,), a, dtype=torch.float32))
        versions.append(torch.tensor([-1] * n_p + list(t.output_versions), dtype=torch.float32))
    batch = PackedBatch.from_sequences(seqs, {"loss_mask": mask, "behav_logprobs": behav, "advantages": advs,
                                              "versions": versions})
    out_lens = torch.tensor([float(len(t.output_ids)) for t in trajs])
    stats = {"reward/mean": float(rewards.mean()), "reward/accuracy": float((rewards > 0.5).float().mean()),
             "rollout/response_len": float(out_lens.mean()), "rollout/response_len_max": float(out_lens.max()),
             "rollout/groups": float(len(groups)), "rollout/trajectories": float(len(trajs)),
             "rollout/interruptions": float(sum(t.num_interruptions for t in trajs))}
    return batch, stats


def share_for_rank(batch: PackedBatch, dp: int, dp_rank: int) -> PackedBatch:
    """This DP rank's sequences, balanced by token count across ranks."""
    if dp == 1:
        return batch
    from realscale.data.packing import balanced_partition

    assign = balanced_partition(batch.seqlens().numpy(), dp)
    mine = [i for i, b in enumerate(assign.tolist()) if b == dp_rank]
    if not mine:
        raise RuntimeError(f"DP rank {dp_rank} received no sequences (batch of {batch.num_seqs} for dp={dp})")
    return batch.select(mine)


def broadcast_batch(batch: PackedBatch | None, src: int = 0) -> PackedBatch:
    """Rank ``src``'s batch on every trainer rank (torch.distributed, gloo or NCCL)."""
    import torch.distributed as dist

    holder = [batch.to_payload() if batch is not None else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=src)
    return PackedBatch.from_payload(holder[0])


def ppo_loss_fn(algo: "AlgoConfig") -> "LossFn":
    """The decoupled PPO objective of DESIGN.md as the engine's loss function."""
    from realscale.algo.losses import loss_kwargs_from_config, ppo_loss

    kwargs = loss_kwargs_from_config(algo)

    def loss(logp: torch.Tensor, mb: PackedBatch, normalizer: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        f = mb.fields
        return ppo_loss(logp, f["behav_logprobs"], f["advantages"], f["loss_mask"],
                        logp_prox=f.get("prox_logprobs") if algo.decoupled else None,
                        logp_ref=f.get("ref_logprobs"),
                        cu_seqlens=mb.cu_seqlens if algo.loss_agg != "token_mean" else None,
                        normalizer=normalizer, **kwargs)
    return loss


def normalizer_fn(algo: "AlgoConfig") -> "NormalizerFn":
    from realscale.algo.losses import loss_normalizer

    return lambda mb: loss_normalizer(mb.fields["loss_mask"], mb.cu_seqlens, algo.loss_agg)


def mini_batches(batch: PackedBatch, n: int) -> list[PackedBatch]:
    """Split a batch's sequences into ``n`` mini-batches (one optimizer step each)."""
    if n <= 1:
        return [batch]
    idx = list(range(batch.num_seqs))
    return [batch.select(idx[i::n]) for i in range(n) if idx[i::n]]


def update_policy(engine: "MegatronEngine", batch: PackedBatch, cfg: "Config",
                  on_share: Callable[[PackedBatch], None] | None = None) -> dict[str, float]:
    """PPO mini-batches over the global batch; each DP rank trains its token-balanced share
    of each mini-batch. Every trainer rank calls it with the same batch. ``on_share``
    (optional) adds per-token fields to each share before the update (reference
    log-probs, values)."""
    r = engine.ranks
    parts = mini_batches(batch, cfg.train.mini_batches)
    if any(p.num_seqs < r.dp for p in parts):
        raise ValueError(f"a mini-batch has fewer sequences than dp={r.dp}: raise rollout.batch_size or lower "
                         f"train.mini_batches ({cfg.train.mini_batches})")
    shares = [share_for_rank(p, r.dp, r.dp_rank) for p in parts]
    for share in shares:
        if cfg.algo.decoupled:
            share.fields["prox_logprobs"] = engine.logprobs(share)["logprobs"]
        if on_share is not None:
            on_share(share)
    loss_fn, norm_fn = ppo_loss_fn(cfg.algo), normalizer_fn(cfg.algo)
    step_stats: dict[str, float] = {}
    for share in shares:
        step_stats = engine.train_step(share, loss_fn, norm_fn)
    return {f"train/{k}": v for k, v in step_stats.items()}

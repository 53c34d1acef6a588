"""The actor's side of one RL step: rollout groups -> packed batch -> PPO update.

- :func:`groups_to_batch`: accepted groups become one packed batch with per-token loss
  mask, behaviour log-probs, advantages (GRPO / leave-one-out, from ``algo``; for GAE the
  token rewards, advantages follow from the critic's values) and the policy version of
  every token, plus rollout statistics. It is two steps, which run in two processes in a
  run: the rollout process packs the groups into flat numpy arrays without torch
  (:func:`realscale.data.raw_batch.pack_raw`), and trainer rank 0 turns what it receives
  into the packed batch (:func:`raw_to_batch`: the tensors, the advantages).
- :func:`split_for_dp` (driver): the batch into ``train.mini_batches`` mini-batches, each
  into token-balanced data-parallel shares; :func:`stage_needs`: which parts of a share
  each pipeline stage reads (the batch scatter sends only those).
- :func:`update_policy`: the decoupled PPO update of ARCHITECTURE.md over this rank's
  shares of the mini-batches; proximal log-probs (and with a critic, values and GAE
  advantages) come from the models before the first update (the first mini-batch's
  proximal log-probs from its own training forward, which those weights run); the critic
  (:mod:`realscale.train.critic`) then takes its value-loss steps on the same shares. With
  a reference policy (:mod:`realscale.train.reference`, ``algo.kl_coef > 0``) its
  log-probs are computed then too, and the loss adds the KL penalty.

The loss arguments come from :func:`realscale.algo.losses.loss_kwargs_from_config`, the
one mapping from ``algo`` knobs to :func:`~realscale.algo.losses.ppo_loss`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from realscale.algo.advantages import grpo_advantages, loo_advantages, masked_moments, normalize_by_moments
from realscale.algo.losses import loss_kwargs_from_config, loss_normalizer, ppo_loss
from realscale.data.packing import balanced_partition
from realscale.data.raw_batch import RawBatch, pack_raw
from realscale.parallel.device import group_backend, to_comm
from realscale.train.batch import PackedBatch
from realscale.train.batch_scatter import StageNeeds
from realscale.train.critic import gae_advantages, token_rewards, update_critic

if TYPE_CHECKING:
    from realscale.config import AlgoConfig, Config
    from realscale.data.groups import Group
    from realscale.train.batch_scatter import StageNeeds
    from realscale.train.critic import CriticEngine
    from realscale.train.engine import LossFn, MegatronEngine, NormalizerFn
    from realscale.train.reference import ReferenceEngine


def group_advantages(rewards: torch.Tensor, cu_groups: torch.Tensor, algo: "AlgoConfig") -> torch.Tensor:
    """One advantage per trajectory from its group's rewards."""

    if algo.adv_estimator == "loo":
        return loo_advantages(rewards, cu_groups=cu_groups)
    if algo.adv_estimator == "grpo":
        return grpo_advantages(rewards, cu_groups=cu_groups, std_norm=algo.group_std_norm)
    if algo.adv_estimator == "reinforce":
        return rewards.clone()
    if algo.adv_estimator == "gae":  # per token, from the critic's values: see update_policy
        return torch.zeros_like(rewards)
    raise ValueError(f"algo.adv_estimator: unknown estimator {algo.adv_estimator!r}")


def groups_to_batch(groups: list["Group"], algo: "AlgoConfig") -> tuple[PackedBatch, dict[str, float]]:
    """Accepted groups -> one packed batch with per-token fields, and rollout stats: the
    torch-free packing (:func:`realscale.data.raw_batch.pack_raw`, what the rollout process
    runs) and :func:`raw_to_batch` (what trainer rank 0 runs on what it receives) in one."""
    raw, stats = pack_raw(groups, algo)
    return raw_to_batch(raw, algo), stats


def raw_to_batch(raw: RawBatch, algo: "AlgoConfig") -> PackedBatch:
    """A raw batch as the trainer's packed batch: ``loss_mask``, ``behav_logprobs``,
    ``versions`` (and ``routed_experts``) as they are (the tensors share the arrays'
    memory), ``advantages`` from each group's rewards (:func:`group_advantages`), every
    token of a trajectory, its prompt's too, carrying the trajectory's; for GAE the token
    rewards as well (the advantages, zeros here, follow from the critic's values)."""
    cu = torch.from_numpy(raw.cu_seqlens)
    rewards = torch.from_numpy(raw.rewards)
    adv = group_advantages(rewards, torch.from_numpy(raw.cu_groups), algo)
    mask = torch.from_numpy(raw.loss_mask)
    fields = {"loss_mask": mask, "behav_logprobs": torch.from_numpy(raw.behav_logprobs),
              "advantages": torch.repeat_interleave(adv, cu[1:] - cu[:-1], output_size=raw.num_tokens),
              "versions": torch.from_numpy(raw.versions)}
    if algo.routing_replay:
        if raw.routed_experts is None:
            raise ValueError("routing replay: the batch was packed without routed experts (algo.routing_replay)")
        fields["routed_experts"] = torch.from_numpy(raw.routed_experts)
    batch = PackedBatch(torch.from_numpy(raw.input_ids), cu, fields)
    if algo.adv_estimator == "gae":
        batch.fields["rewards"] = token_rewards(mask, cu, rewards.tolist())
    return batch


def dp_shares(batch: PackedBatch, dp: int) -> list[PackedBatch]:
    """``batch`` split into ``dp`` shares balanced by token count (one partition for all)."""
    if dp == 1:
        return [batch]
    assign = balanced_partition(batch.seqlens().numpy(), dp).tolist()
    shares = []
    for rank in range(dp):
        mine = [i for i, b in enumerate(assign) if b == rank]
        if not mine:
            raise RuntimeError(f"DP rank {rank} received no sequences (batch of {batch.num_seqs} for dp={dp})")
        shares.append(batch.select(mine))
    return shares


def split_for_dp(batch: PackedBatch, num_mini_batches: int, dp: int,
                 whole_groups: bool = False) -> list[list[PackedBatch]]:
    """The driver's split of a step's batch: ``out[d][m]`` is DP rank ``d``'s share of
    mini-batch ``m`` (what :class:`realscale.train.batch_scatter.BatchScatter` delivers);
    ``whole_groups``: ``train.whole_groups`` (:func:`mini_batches`)."""
    parts = mini_batches(batch, num_mini_batches, whole_groups)
    if any(p.num_seqs < dp for p in parts):
        raise ValueError(f"a mini-batch has fewer sequences than dp={dp}: raise rollout.batch_size or lower "
                         f"train.mini_batches ({num_mini_batches})")
    by_part = [dp_shares(p, dp) for p in parts]
    return [[shares[d] for shares in by_part] for d in range(dp)]


def share_for_rank(batch: PackedBatch, dp: int, dp_rank: int) -> PackedBatch:
    """This DP rank's sequences, balanced by token count across ranks (the rule
    :func:`dp_shares` applies to every rank at once)."""
    return dp_shares(batch, dp)[dp_rank]


def broadcast_batch(batch: PackedBatch | None, src: int = 0) -> PackedBatch:
    """Rank ``src``'s whole batch on every trainer rank, pickled (``broadcast_object_list``).
    The path :class:`~realscale.train.batch_scatter.BatchScatter` replaced in the RL
    loop; tests and ``benchmarks/bench_batch_transfer.py`` compare with it."""

    holder = [batch.to_payload() if batch is not None else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=src)
    return PackedBatch.from_payload(holder[0])


LOSS_FIELDS = ("loss_mask", "behav_logprobs", "advantages")  # the batch fields ppo_loss_fn reads


def stage_needs(algo: "AlgoConfig") -> "StageNeeds":
    """What each pipeline stage of the engine reads from its share (so only that is sent):

    - every stage splits its share into micro-batches by ``cu_seqlens`` and sums the loss
      normaliser over them (``MegatronEngine.train_step`` all-reduces it within the
      stage): :func:`normalizer_fn` reads ``loss_mask``;
    - the first stage embeds ``input_ids``;
    - the last stage takes its targets from ``input_ids`` and evaluates
      :func:`ppo_loss_fn`, which reads :data:`LOSS_FIELDS`;
    - with ``normalize_adv_over_batch`` every stage takes part in the moments' all-reduce
      over its DP group (:func:`normalize_over_batch`): ``advantages`` everywhere;
    - with GAE every rank computes the advantages from the critic's values
      (:func:`realscale.train.critic.gae_advantages`): ``rewards`` everywhere, and the
      batch's placeholder ``advantages`` are not sent at all.

    Proximal and reference log-probs and the critic's values are computed on every rank,
    never sent; the token versions stay on the driver (nothing in the update reads them)."""

    every = ["loss_mask"]
    last = ["input_ids", *LOSS_FIELDS]
    if algo.adv_estimator == "gae":
        every.append("rewards")
        last.remove("advantages")
    elif algo.normalize_adv_over_batch:
        every.append("advantages")
    return StageNeeds(first=("input_ids", *every), middle=tuple(every), last=(*last, *every))


def ppo_loss_fn(algo: "AlgoConfig") -> "LossFn":
    """The decoupled PPO objective (ARCHITECTURE.md, step 2) as the engine's loss function."""

    kwargs = loss_kwargs_from_config(algo)

    def loss(logp: torch.Tensor, mb: PackedBatch, normalizer: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        f = {k: v.to(logp.device) for k, v in mb.fields.items()}  # on GPUs the fields come from CPU
        prox = None
        if algo.decoupled:  # no proximal field: this forward *is* the proximal policy's (update_policy)
            prox = f["prox_logprobs"] if "prox_logprobs" in f else logp.detach()
        return ppo_loss(logp, f["behav_logprobs"], f["advantages"], f["loss_mask"], logp_prox=prox,
                        logp_ref=f.get("ref_logprobs"),
                        cu_seqlens=mb.cu_seqlens if algo.loss_agg != "token_mean" else None,
                        normalizer=normalizer, **kwargs)
    return loss


def normalizer_fn(algo: "AlgoConfig") -> "NormalizerFn":
    return lambda mb: loss_normalizer(mb.fields["loss_mask"], mb.cu_seqlens, algo.loss_agg)


def mini_batches(batch: PackedBatch, n: int, whole_groups: bool = False) -> list[PackedBatch]:
    """Split a batch's sequences into ``n`` mini-batches (one optimizer step each): every
    ``n``-th sequence, or with ``whole_groups`` consecutive runs of sequences (a batch holds
    its groups' samples one after another, :func:`groups_to_batch`; so each mini-batch holds
    whole groups where the group size divides its share, as verl splits by prompts)."""
    if n <= 1:
        return [batch]
    idx = list(range(batch.num_seqs))
    if whole_groups:
        parts = [idx[i * len(idx) // n:(i + 1) * len(idx) // n] for i in range(n)]
    else:
        parts = [idx[i::n] for i in range(n)]
    return [batch.select(p) for p in parts if p]


def normalize_over_batch(shares: list[PackedBatch], dp_group: object | None) -> None:
    """Advantages of every share normalised with the global batch's moments (this rank's
    shares summed, then all-reduced over data-parallel ranks). The moments enter the
    all-reduce through the device helper: the shares live on the host (the batch scatter
    hands them back there), and NCCL takes only CUDA tensors."""

    moments = sum(masked_moments(s.fields["advantages"], s.fields["loss_mask"]) for s in shares)
    if dp_group is not None:
        moments = to_comm(moments, group_backend(dp_group))
        dist.all_reduce(moments, group=dp_group)
    for s in shares:
        s.fields["advantages"] = normalize_by_moments(s.fields["advantages"], s.fields["loss_mask"], moments)


def policy_before_update(engine: "MegatronEngine", shares: list[PackedBatch], algo: "AlgoConfig") -> str:
    """The field of every share that holds the policy's log-probs before this step's
    update, for the measured KL to the reference: the proximal log-probs when decoupled
    (complete once the first share has trained, :func:`update_policy`), otherwise one
    forward for the measurement only, here."""
    if algo.decoupled:
        return "prox_logprobs"
    for share in shares:
        share.fields["policy_logprobs"] = engine.logprobs(share)["logprobs"]
    return "policy_logprobs"


def behaviour_gap(shares: list[PackedBatch], world: bool = False) -> dict[str, float]:
    """How far the trainer's proximal log-probs are from the servers' behaviour log-probs
    on the trained tokens, mean and max of ``|logp_prox - logp_behav|`` over the step: the
    engines' disagreement plus the policy's lag, what importance weighting corrects and
    what routing replay narrows for a mixture of experts. ``world``: reduced over every
    trainer rank (every rank calls it): data-parallel shares add up, tensor-parallel copies
    count every token alike (the mean is unchanged), and pipeline stages that hold no
    behaviour log-probs (``stage_needs``) add nothing, so the driver on the first stage
    reports the last stage's figures."""
    total = torch.zeros(3, dtype=torch.float64)  # count, sum, sum of squares (masked_moments)
    worst = torch.zeros(1, dtype=torch.float64)
    for share in shares:
        f = share.fields
        if "behav_logprobs" not in f or "prox_logprobs" not in f:
            continue
        gap, keep = (f["prox_logprobs"] - f["behav_logprobs"]).abs(), f["loss_mask"] > 0
        total += masked_moments(gap, keep)
        if bool(keep.any()):
            worst = torch.maximum(worst, gap[keep].double().max().reshape(1))
    if world:
        backend = group_backend(None)
        total, worst = to_comm(total, backend), to_comm(worst, backend)
        dist.all_reduce(total)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        total, worst = total.cpu(), worst.cpu()
    return {"actor/behav_prox_gap": float(total[1] / total[0].clamp(min=1)), "actor/behav_prox_gap_max": float(worst)}


def update_policy(engine: "MegatronEngine", shares: list[PackedBatch], cfg: "Config",
                  critic: "CriticEngine | None" = None, ref: "ReferenceEngine | None" = None) -> dict[str, float]:
    """PPO mini-batches: ``shares`` holds this DP rank's token-balanced share of each
    mini-batch (:func:`split_for_dp` on the driver, delivered by the batch scatter); every
    trainer rank calls it. With a ``critic`` (GAE), its values give the advantages and it
    is updated after the actor. With a reference ``ref``, its log-probs enter the loss
    (``algo.kl_coef``) and the measured KL is reported (``actor/kl_ref``)."""
    r = engine.ranks
    for i, share in enumerate(shares):
        # The first mini-batch is trained by the very weights its proximal log-probs describe
        # (no optimizer step has run yet), so its training forward gives them: the loss takes
        # them detached and no forward pass of their own runs (a quarter of the update's
        # compute with one mini-batch); the others need the weights before the first step.
        if cfg.algo.decoupled and i > 0:
            share.fields["prox_logprobs"] = engine.logprobs(share)["logprobs"]
        if critic is not None:
            gae_advantages(critic, share, cfg.algo)
    kl_key = None
    if ref is not None:
        from realscale.train.reference import add_ref_logprobs

        add_ref_logprobs(ref, shares)
        kl_key = policy_before_update(engine, shares, cfg.algo)
    if cfg.algo.normalize_adv_over_batch:
        normalize_over_batch(shares, r.dp_group if r.dp > 1 else None)
    loss_fn, norm_fn = ppo_loss_fn(cfg.algo), normalizer_fn(cfg.algo)
    step_stats: dict[str, float] = {}
    for i, share in enumerate(shares):
        kept: dict[str, torch.Tensor] | None = {} if cfg.algo.decoupled and i == 0 else None
        step_stats = engine.train_step(share, loss_fn, norm_fn, keep=kept)
        if kept is not None:
            share.fields["prox_logprobs"] = kept["outputs"]
    stats = {f"train/{k}": v for k, v in step_stats.items()}
    if kl_key is not None:
        from realscale.train.reference import measured_kl

        stats["actor/kl_ref"] = measured_kl(shares, kl_key, cfg.algo, r)
    if cfg.algo.decoupled:
        stats.update(behaviour_gap(shares, world=dist.is_initialized() and dist.get_world_size() > 1))
    if "train/kl" in stats:
        stats["actor/kl_loss"] = cfg.algo.kl_coef * stats["train/kl"]
    if critic is not None:
        stats.update(update_critic(critic, shares, cfg.critic))
    return stats

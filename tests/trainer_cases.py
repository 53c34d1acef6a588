"""Worker functions for the RL-loop tests (spawned trainer ranks import this module)."""

from __future__ import annotations

from typing import Any

import torch


def synthetic_groups(engine: Any, num_groups: int = 4, n: int = 4, seed: int = 0) -> list[Any]:
    """Groups of trajectories whose behaviour log-probs are the model's own plus noise
    (as a generation server one version behind would give), with mixed rewards."""
    from realscale.data.groups import Group, Trajectory
    from realscale.train.batch import PackedBatch

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.arch.vocab_size
    groups = []
    for g in range(num_groups):
        trajs = []
        prompt = torch.randint(0, vocab, (5 + g,), generator=gen).tolist()
        for i in range(n):
            out = torch.randint(0, vocab, (3 + (i * 5 + g) % 9,), generator=gen).tolist()
            trajs.append(Trajectory(prompt_ids=prompt, output_ids=out, output_logprobs=[0.0] * len(out),
                                    output_versions=[0] * len(out), loss_mask=[1] * len(out),
                                    reward=float((i + g) % 2), group_id=f"g{g}"))
        groups.append(Group(trajs, uid=f"g{g}"))
    flat = [t for grp in groups for t in grp]
    batch = PackedBatch.from_sequences([t.prompt_ids + t.output_ids for t in flat])
    lp = engine.logprobs(batch)["logprobs"]
    for t, i in zip(flat, range(batch.num_seqs)):
        seg = lp[int(batch.cu_seqlens[i]) + len(t.prompt_ids): int(batch.cu_seqlens[i + 1])]
        t.output_logprobs = (seg + 0.05 * torch.randn(seg.shape, generator=gen)).tolist()
    return groups


def scattered(engine: Any, cfg: Any, batch: Any) -> list[Any]:
    """This rank's shares of rank 0's ``batch`` as the RL loop delivers them: split into
    mini-batches and DP shares on rank 0, then the batch scatter (a collective)."""
    import torch.distributed as dist

    from realscale.train.batch_scatter import BatchScatter
    from realscale.train.actor import split_for_dp, stage_needs

    split = split_for_dp(batch, cfg.train.mini_batches, engine.ranks.dp) if dist.get_rank() == 0 else None
    return BatchScatter(engine.ranks, stage_needs(cfg.algo)).scatter(split)[0]


def one_rl_step(model_dir: str, tp: int, dp: int, pp: int = 1) -> dict[str, Any]:
    """groups -> batch (rank 0) -> split into DP shares -> batch scatter -> prox log-probs
    -> PPO step; the log-probs before and after over the whole batch."""
    import torch.distributed as dist

    from realscale.config import load_config
    from realscale.train import actor as trainer
    from realscale.train.engine import EngineConfig, MegatronEngine

    cfg = load_config(None, [f"parallel.tp={tp}", f"parallel.dp={dp}", f"parallel.pp={pp}", "optim.lr=1e-3",
                             "train.mini_batches=2", "train.max_tokens_per_micro_batch=40"])
    engine = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
    batch = None
    if dist.get_rank() == 0:
        batch, _ = trainer.groups_to_batch(synthetic_groups(engine), cfg.algo)
    else:
        synthetic_groups(engine)  # same collectives as rank 0 (log-probs of the same data)
    shares = scattered(engine, cfg, batch)
    whole = trainer.broadcast_batch(batch)  # to compare log-probs over the whole batch
    before = engine.logprobs(whole)["logprobs"]
    stats = trainer.update_policy(engine, shares, cfg)
    after = engine.logprobs(whole)["logprobs"]
    return {"stats": stats, "before": before, "after": after, "advantages": whole.fields["advantages"],
            "loss_mask": whole.fields["loss_mask"], "cu_seqlens": whole.cu_seqlens}


def structured_groups(engine: Any, num_groups: int = 4, n: int = 4, seed: int = 0) -> list[Any]:
    """Groups whose reward is decided by one token: 1 when the answer's second token is
    even. The value of every state after that token is therefore known exactly, before
    it only on average: per-token structure a critic can learn."""
    groups = synthetic_groups(engine, num_groups, n, seed)
    for g in groups:
        for t in g:
            t.reward = float(len(t.output_ids) > 1 and t.output_ids[1] % 2 == 0)
    return groups


def critic_steps(model_dir: str, tp: int, dp: int, steps: int, lam: float = 1.0, critic_lr: float = 1e-3,
                 pp: int = 1) -> dict[str, Any]:
    """``steps`` PPO-with-GAE updates (actor and critic; advantages normalised over the
    global batch) on one structured batch, each step's shares delivered by the batch
    scatter as in the loop: the critic's value loss and values after each step, the
    policy's log-probs after each step, and the first step's advantages."""
    import torch.distributed as dist

    from realscale.config import load_config
    from realscale.train import actor as trainer
    from realscale.train.critic import CriticEngine, critic_engine_config, gae_advantages
    from realscale.train.engine import EngineConfig, MegatronEngine

    cfg = load_config(None, [f"parallel.tp={tp}", f"parallel.dp={dp}", f"parallel.pp={pp}", "optim.lr=1e-4",
                             "train.mini_batches=1", "train.max_tokens_per_micro_batch=40", "algo.adv_estimator=gae", f"critic.lr={critic_lr}",
                             f"algo.lam={lam}", "algo.normalize_adv_over_batch=true"])
    engine = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
    critic = CriticEngine(critic_engine_config(cfg, model_dir))
    batch = None
    if dist.get_rank() == 0:
        batch, _ = trainer.groups_to_batch(structured_groups(engine), cfg.algo)
    else:
        structured_groups(engine)
    batch = trainer.broadcast_batch(batch)
    whole = batch.select(list(range(batch.num_seqs)))  # a copy: updates below write into their shares
    gae_advantages(critic, whole, cfg.algo)  # on the whole batch, before any update
    losses, values, policy = [], [], []
    for _ in range(steps):
        losses.append(trainer.update_policy(engine, scattered(engine, cfg, batch), cfg, critic)["critic/loss"])
        values.append(critic.values(batch))
        policy.append(engine.logprobs(batch)["logprobs"])
    return {"losses": losses, "values": values, "policy": policy,
            "advantages": whole.fields["advantages"],
            "returns": whole.fields["returns"], "rewards": batch.fields["rewards"],
            "loss_mask": batch.fields["loss_mask"], "cu_seqlens": batch.cu_seqlens}


def first_share_shortcut(model_dir: str, mini_batches: int) -> dict[str, Any]:
    """update_policy (the first mini-batch's proximal log-probs from its own training
    forward) against the same update written out the long way on a second engine with the
    same weights: every share's proximal log-probs by a forward pass of their own before
    any step, then the same optimizer steps. The forward passes update_policy ran, the
    proximal log-probs, the step's statistics and the log-probs after, of both."""
    from realscale.config import load_config
    from realscale.train import actor
    from realscale.train.engine import EngineConfig, MegatronEngine

    cfg = load_config(None, ["optim.lr=1e-3", f"train.mini_batches={mini_batches}",
                             "train.max_tokens_per_micro_batch=40"])
    short = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
    long = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
    batch, _ = actor.groups_to_batch(synthetic_groups(short), cfg.algo)
    whole = batch.select(list(range(batch.num_seqs)))
    forwards = []
    counted = short.logprobs
    short.logprobs = lambda b, *a, **k: forwards.append(b.num_tokens) or counted(b, *a, **k)  # type: ignore[method-assign]
    shares = scattered(short, cfg, batch)
    stats = actor.update_policy(short, shares, cfg)
    ref_shares = scattered(long, cfg, batch)
    for share in ref_shares:
        share.fields["prox_logprobs"] = long.logprobs(share)["logprobs"]
    loss_fn, norm_fn = actor.ppo_loss_fn(cfg.algo), actor.normalizer_fn(cfg.algo)
    ref_stats = {}
    for share in ref_shares:
        ref_stats = {f"train/{k}": v for k, v in long.train_step(share, loss_fn, norm_fn).items()}
    ref_stats.update(actor.behaviour_gap(ref_shares))
    return {"forwards": forwards, "stats": stats, "ref_stats": ref_stats,
            "prox": [s.fields["prox_logprobs"] for s in shares],
            "ref_prox": [s.fields["prox_logprobs"] for s in ref_shares],
            "after": counted(whole)["logprobs"], "ref_after": long.logprobs(whole)["logprobs"],
            "shares": len(shares)}

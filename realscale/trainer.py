"""The RL loop: ``realscale train``.

Read top to bottom, one run is:

1. **prepare** (supervisor process): resolve the config, write it into the run directory,
   make the policy model (the warm start via ``realscale sft`` when the recipe asks for
   it), start the generation servers and wait for their health.
2. **trainer ranks** (``tp*pp*dp`` processes, gloo on CPU / NCCL on GPUs): each builds the
   Megatron engine. Rank 0 also runs the asynchronous rollout controller (its own event
   loop in a thread) that keeps prompts in flight under the staleness bound.
3. **each step**: rank 0 takes B accepted groups -> packs them into one batch with
   GRPO/LOO advantages -> sends it to every rank over torch.distributed -> each DP rank
   keeps its token-balanced share -> proximal log-probs are recomputed (decoupled PPO) ->
   PPO mini-batch updates -> the servers are paused, the new weights streamed to them
   (bucketed broadcast) or written to disk, the version bumped, the servers resumed.
4. **checkpoints** every ``run.checkpoint_every`` steps (atomic): model, optimizer, data
   position, version, staleness counters. A run started again in the same directory
   resumes from the last one.
5. **report**: JSONL metrics every step, a progress bar, and at the end a plot and a
   one-screen summary; held-out accuracy before and after.

The supervisor watches every process and stops all of them on error or Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict
from typing import Any

import torch

from realscale.config import Config, ConfigError, load_config, run_dir, save_config
from realscale.rollout.rewards import reward_pool_stats

LATEST = "latest_checkpoint"


# ----------------------------------------------------------------------------- batches


def groups_to_batch(groups: list[Any], algo: Any) -> tuple[Any, dict[str, float]]:
    """Accepted groups -> one packed batch with per-token fields, and rollout stats."""
    from realscale.algo.advantages import grpo_advantages, loo_advantages
    from realscale.train.batch import PackedBatch

    trajs = [t for g in groups for t in g]
    sizes = torch.tensor([len(g) for g in groups])
    cu_groups = torch.zeros(len(groups) + 1, dtype=torch.long)
    cu_groups[1:] = torch.cumsum(sizes, 0)
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    if algo.adv_estimator == "loo":
        adv = loo_advantages(rewards, cu_groups=cu_groups)
    elif algo.adv_estimator == "grpo":
        adv = grpo_advantages(rewards, cu_groups=cu_groups, std_norm=algo.group_std_norm)
    else:
        raise ValueError(f"algo.adv_estimator={algo.adv_estimator!r} needs a critic, which this loop does not train")
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


def share_for_rank(batch: Any, dp: int, dp_rank: int) -> Any:
    """This DP rank's sequences, balanced by token count across ranks."""
    if dp == 1:
        return batch
    from realscale.data.packing import balanced_partition

    assign = balanced_partition(batch.seqlens().numpy(), dp)
    mine = [i for i, b in enumerate(assign.tolist()) if b == dp_rank]
    if not mine:
        raise RuntimeError(f"DP rank {dp_rank} received no sequences (batch of {batch.num_seqs} for dp={dp})")
    return batch.select(mine)


def broadcast_batch(batch: Any | None, src: int = 0) -> Any:
    """Rank ``src``'s batch on every trainer rank (torch.distributed, gloo or NCCL)."""
    import torch.distributed as dist

    from realscale.train.batch import PackedBatch

    holder = [batch.to_payload() if batch is not None else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=src)
    return PackedBatch.from_payload(holder[0])


def ppo_loss_fn(algo: Any) -> Any:
    """The decoupled PPO objective of DESIGN.md as the engine's loss function."""
    from realscale.algo.losses import ppo_loss

    def loss(logp: torch.Tensor, mb: Any, normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        f = mb.fields
        return ppo_loss(logp, f["behav_logprobs"], f["advantages"], f["loss_mask"],
                        logp_prox=f.get("prox_logprobs") if algo.decoupled else None,
                        eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, dual_clip=algo.dual_clip,
                        imp_weight_cap=algo.behav_imp_weight_cap, imp_weight_mode=algo.behav_imp_weight_mode,
                        agg=algo.loss_agg, cu_seqlens=mb.cu_seqlens if algo.loss_agg != "token_mean" else None,
                        normalizer=normalizer)
    return loss


def normalizer_fn(algo: Any) -> Any:
    from realscale.algo.losses import loss_normalizer

    return lambda mb: loss_normalizer(mb.fields["loss_mask"], mb.cu_seqlens, algo.loss_agg)


def mini_batches(batch: Any, n: int) -> list[Any]:
    """Split a batch's sequences into ``n`` mini-batches (one optimizer step each)."""
    if n <= 1:
        return [batch]
    idx = list(range(batch.num_seqs))
    return [batch.select(idx[i::n]) for i in range(n) if idx[i::n]]


# ----------------------------------------------------------------------------- rank main


class RankContext:
    """What one trainer rank holds during a run."""

    def __init__(self, cfg: Config, model_dir: str, server_urls: list[str], out_dir: str) -> None:
        import torch.distributed as dist

        from realscale.train.engine import EngineConfig, MegatronEngine

        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
        self.cfg, self.out_dir, self.server_urls = cfg, out_dir, server_urls
        self.rank = dist.get_rank()
        self.engine = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
        self.step, self.version = 0, 0
        self.controller: Any = None
        self.sender: Any = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def make_controller(cfg: Config, model_dir: str, server_urls: list[str], out_dir: str) -> Any:
    """The rollout controller (rank 0 only): dataset -> workflow -> servers -> buffer."""
    import inspect

    from transformers import AutoTokenizer

    from realscale.data.dataset import from_config as dataset_from_config
    from realscale.rollout.controller import RolloutController
    from realscale.rollout.rewards import reward_fn_for
    from realscale.rollout.workflows import SingleTurnWorkflow, sampling_params_from_config

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data_cfg = cfg.data
    if data_cfg.source.startswith("task:"):
        from realscale.tasks.arith import resolve_task_source, task_from_config

        source = resolve_task_source(data_cfg.source, task_from_config(data_cfg), os.path.join(out_dir, "data"))
        data_cfg = type(data_cfg)(**{**asdict(data_cfg), "source": source})
    dataset = dataset_from_config(data_cfg, seed=cfg.run.seed, prompt_len=lambda t: len(tokenizer.encode(t)))

    async def reward(prompt: str, completion: str, sample: Any) -> Any:
        out = reward_fn_for(cfg.reward, sample)(prompt, completion, sample)
        return await out if inspect.isawaitable(out) else out

    if cfg.rollout.workflow != "single_turn":
        raise ValueError(f"rollout.workflow={cfg.rollout.workflow!r}: the trainer wires single_turn; "
                         "multi_turn needs an environment factory (see realscale.rollout.workflows)")
    workflow = SingleTurnWorkflow(tokenizer, cfg.rollout.n_samples, sampling_params_from_config(cfg.generate),
                                  reward, reward_timeout=cfg.reward.timeout * 4)
    # from_config: every rollout knob (max_ahead, max_consecutive_failures ...) reaches the controller
    return RolloutController.from_config(cfg, server_urls, dataset, workflow)


def _call(ctx: RankContext, fn: Any) -> Any:
    """Run ``fn(client)`` (a coroutine) on the controller's event loop and wait for it."""
    return ctx.controller.call(fn)


def push_weights(ctx: RankContext) -> dict[str, float]:
    """Pause generation, move the new weights to every server, bump the version, resume.
    Every trainer rank calls it (the export has collectives)."""
    start = time.perf_counter()
    cfg = ctx.cfg
    new_version = ctx.version + 1
    sent = 0
    if ctx.is_driver:
        ctx.controller.pause()
        _call(ctx, lambda c: c.pause(cfg.generate.pause_mode))
    if cfg.generate.weight_update == "disk":
        path = os.path.join(ctx.out_dir, "weights", f"v{new_version}")
        ctx.engine.save_hf(path)
        if ctx.is_driver:
            _call(ctx, lambda c: c.update_weights_from_disk(path, weight_version=new_version))
    else:
        buckets = ctx.engine.export_hf_weights(bucket_bytes=64 << 20)
        if ctx.is_driver:
            sent = _call(ctx, lambda c: c.update_weights(ctx.sender, buckets, weight_version=new_version))
        else:
            for _ in buckets:  # take part in the gathers; only rank 0 sends
                pass
    ctx.version = new_version
    if ctx.is_driver:
        ctx.controller.set_version(new_version)
        _call(ctx, lambda c: c.resume())
        ctx.controller.resume()
    return {"perf/weight_sync_s": time.perf_counter() - start, "perf/weight_sync_bytes": float(sent)}


def connect_weight_sender(ctx: RankContext) -> None:
    """Rank 0 hosts a torch.distributed group with every server (gloo here, NCCL on GPUs)."""
    from realscale.generate.weight_sync import WeightSender
    from realscale.parallel.spawn import free_port

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    from realscale.launcher import advertise_host

    ctx.sender = WeightSender(advertise_host(), free_port(), world_size=len(ctx.server_urls) + 1,
                              group_name="realscale-weights", backend=backend)
    _call(ctx, lambda c: c.init_weights_update_group(ctx.sender))


def update_policy(engine: Any, batch: Any, cfg: Config) -> dict[str, float]:
    """PPO mini-batches over the global batch; each DP rank trains its token-balanced share
    of each mini-batch. Proximal log-probs come from the policy before the first update.
    Every trainer rank calls it with the same (broadcast) batch."""
    r = engine.ranks
    parts = mini_batches(batch, cfg.train.mini_batches)
    if any(p.num_seqs < r.dp for p in parts):
        raise ValueError(f"a mini-batch has fewer sequences than dp={r.dp}: raise rollout.batch_size or lower "
                         f"train.mini_batches ({cfg.train.mini_batches})")
    shares = [share_for_rank(p, r.dp, r.dp_rank) for p in parts]
    if cfg.algo.decoupled:
        for share in shares:
            share.fields["prox_logprobs"] = engine.logprobs(share)["logprobs"]
    loss_fn, norm_fn = ppo_loss_fn(cfg.algo), normalizer_fn(cfg.algo)
    step_stats: dict[str, float] = {}
    for share in shares:
        step_stats = engine.train_step(share, loss_fn, norm_fn)
    return {f"train/{k}": v for k, v in step_stats.items()}


def train_one_step(ctx: RankContext) -> dict[str, float]:
    """Take a batch, update the policy, publish the weights. Every rank calls it."""
    cfg = ctx.cfg
    t0 = time.perf_counter()
    stats: dict[str, float] = {}
    batch = None
    if ctx.is_driver:
        groups = ctx.controller.get_batch(cfg.rollout.batch_size, timeout=cfg.generate.request_timeout)
        batch, stats = groups_to_batch(groups, cfg.algo)
        lags = [ctx.version - g.min_version for g in groups]
        stats.update({"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))})
        _record_trained(ctx.out_dir, ctx.step + 1, groups)
    t_wait = time.perf_counter() - t0
    t_train = time.perf_counter()
    batch = broadcast_batch(batch)
    stats.update(update_policy(ctx.engine, batch, cfg))
    t_train = time.perf_counter() - t_train
    stats.update(push_weights(ctx))
    trained = float(batch.fields["loss_mask"].sum())
    elapsed = time.perf_counter() - t0
    stats.update({"perf/step_s": elapsed, "perf/wait_rollout_s": t_wait, "perf/train_s": t_train,
                  "perf/trained_tokens": trained, "perf/trained_tokens_per_s": trained / max(elapsed, 1e-9),
                  "version": float(ctx.version)})
    ctx.step += 1
    return stats


def _record_trained(out_dir: str, step: int, groups: list[Any]) -> None:
    """Which prompts each step trained on (audits resume: nothing repeated or skipped)."""
    with open(os.path.join(out_dir, "trained_uids.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, "uids": [g.uid for g in groups]}) + "\n")


def truncate_logs(out_dir: str, last_step: int) -> None:
    """On resume: drop log records of steps after the checkpoint (they are redone), so
    every step appears once in metrics.jsonl and trained_uids.jsonl."""
    for name in ("metrics.jsonl", "trained_uids.jsonl"):
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as fh:
            keep = [line for line in fh if line.strip() and json.loads(line)["step"] <= last_step]
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(keep)
        os.replace(tmp, path)


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` (under ``checkpoints/``)."""
    return f"step{step:06d}"


def save_checkpoint(ctx: RankContext) -> None:
    ckpt = os.path.join(ctx.out_dir, "checkpoints", checkpoint_name(ctx.step))
    extra = {"step": ctx.step, "version": ctx.version}
    if ctx.is_driver:
        extra["controller"] = ctx.controller.state_dict()
    holder = [extra]
    import torch.distributed as dist

    dist.broadcast_object_list(holder, src=0)
    ctx.engine.save(ckpt, extra=holder[0])
    if ctx.is_driver:  # the pointer moves only after the checkpoint is complete
        tmp = os.path.join(ctx.out_dir, LATEST + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(ckpt)
        os.replace(tmp, os.path.join(ctx.out_dir, LATEST))


def latest_checkpoint(out_dir: str) -> str | None:
    path = os.path.join(out_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        ckpt = fh.read().strip()
    return ckpt if os.path.isdir(ckpt) else None


def stop_requested(ctx: RankContext) -> bool:
    """Has the launcher asked the run to stop (SIGUSR1: time limit or pre-emption)? Rank 0
    reads the request; every rank gets its answer, so all stop after the same step."""
    import torch.distributed as dist

    from realscale.launcher import stop_reason

    holder = [ctx.is_driver and stop_reason(ctx.out_dir) is not None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    return bool(holder[0])


def rank_main(cfg_dict: dict[str, Any], model_dir: str, server_urls: list[str], out_dir: str) -> None:
    """One trainer rank from start to finish."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg_dict))
    ctx = RankContext(cfg, model_dir, server_urls, out_dir)
    resume = latest_checkpoint(out_dir)
    extra: dict[str, Any] = {}
    if resume:
        extra = ctx.engine.load(resume)
        ctx.step, ctx.version = int(extra["step"]), int(extra["version"])
    logger = None
    if ctx.is_driver:
        if resume:
            truncate_logs(out_dir, ctx.step)
        ctx.controller = make_controller(cfg, model_dir, server_urls, out_dir)
        if "controller" in extra:
            ctx.controller.load_state_dict(extra["controller"])
        ctx.controller.pause()  # nothing is generated until the servers hold this run's weights
        ctx.controller.start()
        if cfg.generate.weight_update == "distributed":
            connect_weight_sender(ctx)
        from realscale.metrics import MetricsLogger

        logger = MetricsLogger(out_dir, cfg.run.total_steps, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                               wandb_mode=cfg.run.wandb_mode, start_step=ctx.step)
    try:
        if resume:
            # the servers started from the base model: give them the checkpoint's weights
            ctx.version -= 1
            push_weights(ctx)
        elif ctx.is_driver:
            ctx.controller.resume()
        while ctx.step < cfg.run.total_steps:
            stats = train_one_step(ctx)
            if logger is not None and ctx.step % cfg.run.log_every == 0:
                ctl = ctx.controller.stats()
                stats.update({f"rollout_ctl/{k}": v for k, v in ctl.items() if isinstance(v, (int, float))})
                stats.update({f"rollout_ctl/rejected_{why}": n for why, n in ctl["rejected_by_reason"].items()})
                stats.update(reward_pool_stats())  # code reward: runs by reason, sandbox_weakened
                logger.log(ctx.step, stats)
            every = cfg.run.checkpoint_every
            saved = (every and ctx.step % every == 0) or ctx.step == cfg.run.total_steps
            if saved:
                save_checkpoint(ctx)
            if ctx.step < cfg.run.total_steps and stop_requested(ctx):
                if not saved:  # pre-emption / time limit: keep this step's work
                    save_checkpoint(ctx)
                break
    finally:
        if ctx.is_driver:
            if ctx.controller is not None:
                hist = ctx.controller.stats()["staleness_hist"]
                with open(os.path.join(out_dir, "staleness_hist.json"), "w", encoding="utf-8") as fh:
                    json.dump({str(k): v for k, v in hist.items()}, fh)
                ctx.controller.stop()
            if ctx.sender is not None:
                ctx.sender.close()
            if logger is not None:
                logger.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- supervisor


def prepare_model(cfg: Config, out_dir: str) -> str:
    """The policy's HF directory: ``model.path: sft`` means the warm start of the ``sft``
    section (run now unless already there); anything else is a directory or tiny name."""
    from realscale.models.tiny import resolve_model_path

    if cfg.model.path == "sft":
        from realscale.sft import run_sft, sft_output_dir

        target = sft_output_dir(cfg)
        if not os.path.isfile(os.path.join(target, "model.safetensors")):
            run_sft(cfg)
        else:
            _check_warm_start(cfg, target)
        return target
    return resolve_model_path(cfg.model.path)


def _warm_start_recipe(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """What a warm start depends on: the sft section (less where it goes and its own
    evaluation), the data section's task knobs and the seed."""
    sft = {k: v for k, v in cfg_dict["sft"].items() if k not in ("output", "eval_size")}
    data = {k: v for k, v in cfg_dict["data"].items() if k.startswith("task_") or k in ("source", "size")}
    return {"sft": sft, "data": data, "seed": cfg_dict["run"]["seed"]}


def _check_warm_start(cfg: Config, target: str) -> None:
    """A cached warm start made by another recipe must not be reused silently."""
    from omegaconf import OmegaConf

    saved_path = os.path.join(target, "config.yaml")
    if not os.path.isfile(saved_path):
        return  # made by hand (or an older version): trust the user
    saved = OmegaConf.to_container(OmegaConf.load(saved_path))
    want, have = _warm_start_recipe(asdict(cfg)), _warm_start_recipe(saved)
    diff = [f"{sec}.{k}" for sec in ("sft", "data") for k in want[sec] if want[sec][k] != have[sec].get(k)]
    if want["seed"] != have["seed"]:
        diff.append("run.seed")
    if diff:
        raise ConfigError(f"the warm start in {target} was made with other settings ({', '.join(diff)}); "
                          f"delete that directory to retrain it, or set sft.output to a new directory")


def evaluate_heldout(cfg: Config, model_dir: str) -> dict[str, float] | None:
    """Accuracy on the task's held-out split: greedy, and sampled at the run's temperature
    (4 samples per prompt: the policy RL trains). None for sources without a split."""
    if not cfg.data.source.startswith("task:"):
        return None
    from realscale.eval import evaluate
    from realscale.tasks.arith import task_from_config

    problems = task_from_config(cfg.data).split("heldout")
    greedy = evaluate(model_dir, problems, max_new_tokens=cfg.generate.max_new_tokens)
    sampled = evaluate(model_dir, problems, samples=4, temperature=cfg.generate.temperature,
                       max_new_tokens=cfg.generate.max_new_tokens, seed=cfg.run.seed)
    return {"greedy": greedy.accuracy, "sampled": sampled.accuracy, "pass@4": sampled.pass_at_k}


def apply_plan(cfg: Config) -> Config:
    """``parallel.plan`` set: take the trainer's (dp, tp, pp) from the plan's actor_train role."""
    if not cfg.parallel.plan:
        return cfg
    from realscale.config import ConfigError
    from realscale.planner.plan import Plan

    if not os.path.exists(cfg.parallel.plan):
        raise ConfigError(f"parallel.plan: file not found: {cfg.parallel.plan}")
    plan = Plan.load(cfg.parallel.plan)
    if "actor_train" not in plan.roles:
        raise ConfigError(f"parallel.plan: {cfg.parallel.plan} has no actor_train role (roles: {', '.join(plan.roles)})")
    s = plan.roles["actor_train"].strategy
    cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp = s.dp, s.tp, s.pp
    if cfg.parallel.sequence_parallel and s.tp == 1:
        cfg.parallel.sequence_parallel = False  # nothing to split the sequence over
    return cfg


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def train(cfg: Config) -> int:
    """The supervisor: prepare, start servers and trainer ranks (on this machine or as
    Slurm job steps, see realscale/launcher/), watch, report."""
    previous_usr1 = signal.getsignal(signal.SIGUSR1)
    try:
        return _supervise(cfg)
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)


def _supervise(cfg: Config) -> int:
    from realscale.launcher import LaunchError, backend_for, clear_stop, request_stop, stop_reason
    from realscale.metrics import plot_run, summary_text

    cfg = apply_plan(cfg)
    out_dir = run_dir(cfg)
    os.makedirs(out_dir, exist_ok=True)
    try:
        backend = backend_for(cfg, out_dir)
        backend.prepare()  # under Slurm: is the run directory on storage every node shares?
    except LaunchError as exc:
        print(f"realscale: {exc}", flush=True)
        return 1
    clear_stop(out_dir)  # the request that stopped an earlier (requeued) run is done with
    # USR1: Slurm's notice before the time limit (--signal=B:USR1@secs) or pre-emption
    signal.signal(signal.SIGUSR1, lambda *_: request_stop(out_dir, "requeue"))
    save_config(cfg, out_dir)
    t0 = time.time()
    model_dir = prepare_model(cfg, out_dir)
    resumed = latest_checkpoint(out_dir) is not None
    start_path = os.path.join(out_dir, "eval_start.json")
    if resumed and os.path.exists(start_path):
        with open(start_path, encoding="utf-8") as fh:
            acc_start = json.load(fh)
    else:
        acc_start = evaluate_heldout(cfg, model_dir)
        with open(start_path, "w", encoding="utf-8") as fh:
            json.dump(acc_start, fh)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the run like Ctrl-C
    code = 0
    try:
        if stop_reason(out_dir) is None:  # a stop requested while preparing: start nothing
            urls = backend.start_servers(model_dir, asdict(cfg))
            backend.start_ranks(rank_main, cfg.parallel.world_size, (asdict(cfg), model_dir, urls, out_dir))
            code = backend.wait()
    except KeyboardInterrupt:
        print("\nrealscale: interrupted; stopping trainer ranks and generation servers")
        code = 130
    except LaunchError as exc:
        print(f"realscale: {exc}", flush=True)
        code = 1
    finally:
        backend.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a late notice must not kill the final evaluation
    reason = stop_reason(out_dir)
    done = (latest_checkpoint(out_dir) or "").endswith(checkpoint_name(cfg.run.total_steps))
    if code == 0 and reason is not None and not done:  # (a request after the last step changes nothing)
        return stopped_early(cfg, backend, out_dir, reason)
    if code != 0:
        print(f"realscale: a process of the run failed (exit code {code}); logs under {out_dir}")
        return code
    final_dir = os.path.join(out_dir, "final")
    acc_end = _final_accuracy(cfg, out_dir, final_dir)
    hist_path = os.path.join(out_dir, "staleness_hist.json")
    hist = {int(k): v for k, v in json.load(open(hist_path)).items()} if os.path.exists(hist_path) else {}
    extra = {"total time": f"{time.time() - t0:.0f} s"}
    for kind in ("greedy", "sampled"):
        extra[f"held-out accuracy ({kind})"] = (f"{_pct(acc_start and acc_start[kind])} -> "
                                                f"{_pct(acc_end and acc_end[kind])}")
    if acc_end is not None:
        from realscale.metrics import MetricsLogger

        log = MetricsLogger(out_dir, 0, progress=False)
        record = {f"eval/{k}": v for k, v in acc_end.items()}
        record["eval/accuracy"] = acc_end["greedy"]
        record.update({f"eval/start_{k}": v for k, v in (acc_start or {}).items()})
        log.log(cfg.run.total_steps, record)
        log.close()
    plot_run(out_dir, hist)
    print(summary_text(out_dir, extra))
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump({"accuracy_start": acc_start, "accuracy_end": acc_end, "seconds": time.time() - t0,
                   "staleness_hist": hist}, fh, indent=1)
    return 0


def stopped_early(cfg: Config, backend: Any, out_dir: str, reason: str) -> int:
    """The ranks checkpointed and exited on a stop request: requeue the Slurm job (it
    resumes from that checkpoint), or say how to resume a local run."""
    ckpt = latest_checkpoint(out_dir)
    print(f"realscale: stopped on request ({reason}); last checkpoint {ckpt or 'none'}", flush=True)
    if reason == "requeue" and cfg.launch.requeue:
        backend.requeue()
    return 0


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _final_accuracy(cfg: Config, out_dir: str, final_dir: str) -> dict[str, float] | None:
    """Export the last checkpoint to HF and evaluate it on the held-out split."""
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None or not cfg.data.source.startswith("task:"):
        return None
    from realscale.parallel.spawn import run_distributed

    run_distributed(_export_final, cfg.parallel.tp * cfg.parallel.pp, asdict(cfg), ckpt, final_dir,
                    prepare_model(cfg, out_dir), timeout=1200)
    return evaluate_heldout(cfg, final_dir)


def _export_final(cfg_dict: dict[str, Any], ckpt: str, final_dir: str, model_dir: str) -> None:
    from omegaconf import OmegaConf

    from realscale.train.engine import EngineConfig, MegatronEngine

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg_dict))
    cfg.parallel.dp = 1
    eng = MegatronEngine(EngineConfig.from_config(cfg, model_dir, train=False))
    eng.load(ckpt)
    eng.save_hf(final_dir)


def main(recipe: str | None, overrides: list[str]) -> int:
    cfg = load_config(recipe, overrides)
    return train(cfg)

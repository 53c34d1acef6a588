"""The RL loop, as one trainer rank runs it (``realscale train`` starts one per device;
:mod:`realscale.launcher.supervisor` prepares the run and watches the processes).

Every rank builds the Megatron engine on its layout and resumes from the run's last
checkpoint. Rank 0 (the *driver*) also starts the rollout controller, in a process of its
own (:mod:`realscale.rollout.process`): it keeps prompts in flight on the generation
servers within the staleness bound η. The driver holds the servers' control. Then, each
step:

1. **batch** — the controller hands over B accepted groups, packed with GRPO/LOO
   advantages (GAE: token rewards), waiting for rollouts if needed; the driver splits
   every mini-batch into token-balanced data-parallel shares, and each rank receives only
   its share, only the parts its pipeline stage reads (:mod:`realscale.train.batch_scatter`);
   while the driver waits, a rollout shard left without a server in rotation makes every
   rank republish the current version to the servers the launcher restarted
   (:mod:`realscale.publish.outage`);
2. **update** — decoupled PPO: proximal log-probs recomputed, mini-batch updates, each
   data-parallel rank on its share; with GAE the critic
   (:mod:`realscale.train.critic`, same ranks and layout) gives values first and takes its
   value-loss steps after; with ``algo.kl_coef > 0`` the frozen reference policy
   (:mod:`realscale.train.reference`, same ranks and layout) gives reference log-probs
   for the KL penalty;
3. **publish** — pause the servers, move the new weights, bump the version, resume
   (:class:`realscale.publish.publisher.WeightPublisher`);
4. **log and checkpoint** — metrics every ``run.log_every`` steps, a checkpoint every
   ``run.checkpoint_every`` steps and at the end; a stop request (SIGUSR1: time limit or
   pre-emption) checkpoints and exits after the current step.

After the last step every rank takes part in the HF export of the trained weights,
``<run>/final`` (:func:`realscale.train.checkpoint.export_final`: the gathers on the
ranks' own devices and backend), which the supervisor then evaluates.

Asynchrony is all in the controller: while step N trains, generation for later steps
goes on under the old weights, and η bounds how old a trained token may be.

Colocated mode (``parallel.mode: colocated``) has no servers of its own: the trainer ranks
generate in a layout of their own while the driver waits for its batch, and "publish"
reshards the weights into that layout in place
(:class:`realscale.serve.colocated.ColocatedGeneration`; η = 0).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from realscale.config import Config, config_from_dict
from realscale.inference.health import wait_until_serving
from realscale.inference.roster import read_roster, roster_path
from realscale.launcher.spec import stop_reason
from realscale.metrics import MetricsLogger
from realscale.parallel.device import collective_timeout_s, init_distributed
from realscale.parallel.rank_metrics import ComputeClock, CpuClock, gather_figures, step_figures
from realscale.publish.control import ServerControl, ServerEndpoint
from realscale.publish.outage import NONE, POLL_S, REPUBLISH, OutageWatch
from realscale.publish.publisher import Publisher, WeightPublisher, transport_for
from realscale.rollout.controller import client_factory
from realscale.rollout.process import start_rollouts
from realscale.rollout.sharded import start_sharded
from realscale.serve.colocated import ColocatedGeneration
from realscale.train.actor import split_for_dp, stage_needs, update_policy
from realscale.train.batch import PackedBatch
from realscale.train.batch_scatter import BatchScatter, ScatterStats
from realscale.train.checkpoint import (Checkpointer, disk_usage, export_dir, export_final, record_trained,
                                         truncate_logs)
from realscale.train.critic import CriticEngine, critic_engine_config
from realscale.train.engine import EngineConfig, MegatronEngine
from realscale.train.reference import reference_for

if TYPE_CHECKING:
    from realscale.metrics import MetricsLogger
    from realscale.rollout.process import Rollouts as OneProcess
    from realscale.rollout.sharded import ShardedRollouts

    Rollouts = OneProcess | ShardedRollouts


class Trainer:
    """One trainer rank of a run: engine, (driver only) controller and logger, publisher."""

    def __init__(self, cfg: Config, model_dir: str, server_urls: list[str], out_dir: str) -> None:
        init_distributed(cfg.parallel.backend, collective_timeout_s(cfg.parallel.collective_timeout_s))
        self.cfg, self.out_dir, self.server_urls = cfg, out_dir, list(server_urls)
        self.is_driver = dist.get_rank() == 0
        self.checkpoints = Checkpointer(out_dir, cfg.run.keep_checkpoints, cfg.run.pin_checkpoints, self.is_driver)
        self.controller: Rollouts | None = None
        # A fresh run's servers already hold its weights (version 0): the driver starts the
        # rollouts generating first, and its engine is built while the first batch generates.
        if self.is_driver and cfg.parallel.mode != "colocated" and self.checkpoints.latest() is None:
            self.controller = self._start_rollouts(model_dir, server_urls, None, go=True)
        self.engine = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
        self.critic: CriticEngine | None = None
        if cfg.algo.adv_estimator == "gae":  # PPO with a value model, beside the actor
            self.critic = CriticEngine(critic_engine_config(cfg, model_dir))
        self.ref = reference_for(cfg, model_dir)  # KL penalty: frozen starting weights, beside the actor
        self.scatter = BatchScatter(self.engine.ranks, stage_needs(cfg.algo))
        self.clock = ComputeClock(*(m.config for m in (self.engine, self.critic, self.ref) if m is not None))
        self.step, self.version = 0, 0
        self.resumed_from, extra = self.checkpoints.load(self.engine, self.critic)
        if self.resumed_from:
            self.step, self.version = int(extra["step"]), int(extra["version"])
        self.colocated: ColocatedGeneration | None = None
        if cfg.parallel.mode == "colocated":  # these ranks generate too: their servers replace the launcher's
            self.colocated = ColocatedGeneration(cfg, model_dir, self.engine, idle_while_generating=[self.ref])
            server_urls = self.colocated.urls
        self.logger: MetricsLogger | None = None
        self.outage: OutageWatch | None = None  # driver, servers of their own: every server down at once?
        control = None
        if self.is_driver:
            self.controller, self.logger = self._start_driver(model_dir, server_urls, extra)
            # the launcher's roster names the servers it restarts (none in colocated mode)
            roster = None if self.colocated is not None else roster_path(out_dir)
            control = ServerControl(self.controller, [ServerEndpoint(u, cfg.generate.tp) for u in server_urls],
                                    client_factory(cfg, server_urls), roster=roster, ranks_per_server=cfg.generate.tp)
            if self.colocated is None:
                roster = roster if os.path.exists(roster) else None  # no launcher's roster: nobody restarts servers
                self.outage = OutageWatch(roster, control.known, os.path.join(out_dir, "logs"))
        if self.colocated is not None:
            self.colocated.control = control
        self.publisher: Publisher = self.colocated or WeightPublisher(transport_for(cfg, out_dir), control,
                                                           cfg.generate.pause_mode)

    def _start_rollouts(self, model_dir: str, server_urls: list[str], state: dict[str, Any] | None, *,
                        go: bool = False) -> "Rollouts":
        start = start_sharded if self.cfg.rollout.processes > 1 else start_rollouts  # the rollout tier, scaled out
        return start(self.cfg, model_dir, server_urls, self.out_dir, state, go=go)

    def _start_driver(self, model_dir: str, server_urls: list[str], extra: dict[str, Any]
                      ) -> tuple["Rollouts", "MetricsLogger"]:
        """The rollouts (paused until the servers hold this run's weights; a fresh run's
        are generating already) and the metrics logger; on resume, logs are cut back to
        the checkpoint's step."""

        if self.resumed_from:
            truncate_logs(self.out_dir, self.step)
        controller = self.controller or self._start_rollouts(model_dir, server_urls, extra.get("controller"))
        run = self.cfg.run
        logger = MetricsLogger(self.out_dir, run.total_steps, tensorboard=run.tensorboard, wandb=run.wandb,
                               wandb_mode=run.wandb_mode, start_step=self.step)
        return controller, logger

    # ------------------------------------------------------------------ the loop

    def train(self) -> None:
        cfg = self.cfg
        try:
            self._start_generation()
            while self.step < cfg.run.total_steps:
                stats = self.train_step()
                self._log(stats)
                saved = self._checkpoint_due()
                if saved:
                    self.save()
                self._export_due()
                if self.step < cfg.run.total_steps and self._stop_requested():
                    if not saved:  # pre-emption / time limit: keep this step's work
                        self.save()
                    break
            if self.step >= cfg.run.total_steps:  # done (or resumed done): every rank exports
                export_final(self.engine, self.out_dir, self.step)
        finally:
            self.close()

    def train_step(self) -> dict[str, float]:
        """Take a batch, update the policy, publish the weights. Every rank calls it."""
        t0 = time.perf_counter()
        shares, stats, moved = self._next_batch()
        t_wait = time.perf_counter() - t0
        self.clock.seconds()  # compute timed from here: this step's update only
        cpu = CpuClock()  # was the update starved of a core? (rank_metrics docstring)
        stats.update(update_policy(self.engine, shares, self.cfg, self.critic, self.ref))
        t_train = time.perf_counter() - t0 - t_wait
        stats.update({f"perf/train_{k}": v for k, v in cpu.seconds().items()})
        # every rank's transfer and compute figures, gathered: does rank 0 hold the others up?
        stats.update(step_figures(gather_figures({**moved.local(), "compute_s": self.clock.seconds()})))
        self.version += 1
        stats.update(self.publisher.publish(self.engine, self.version))
        self.step += 1
        trained = stats.get("perf/trained_tokens", 0.0)  # known on the driver, which logs
        elapsed = time.perf_counter() - t0
        stats.update({"perf/step_s": elapsed, "perf/wait_rollout_s": t_wait, "perf/train_s": t_train,
                      "perf/trained_tokens": trained, "perf/trained_tokens_per_s": trained / max(elapsed, 1e-9),
                      "version": float(self.version)})
        return stats

    # ------------------------------------------------------------------ pieces of a step

    def _start_generation(self) -> None:
        """Servers start from the base model: after a resume they first get the
        checkpoint's weights (same version); a fresh run's rollouts are generating
        already (started before the engine was built). Colocated ranks start with no
        generation weights: they always get them first."""
        if self.resumed_from and self.colocated is None and self.is_driver:
            # the servers start beside the ranks (launcher/supervisor.py): up before the weights go
            wait_until_serving(self.server_urls, self.cfg.launch.health_timeout)
        if self.resumed_from or self.colocated is not None:
            self.publisher.publish(self.engine, self.version)

    def _next_batch(self) -> tuple[list[PackedBatch], dict[str, float], ScatterStats]:
        """This rank's share of every mini-batch of the next B groups."""
        split, stats = None, {}
        rollouts, generation = self._collect()
        if self.is_driver:
            record_trained(self.out_dir, self.step + 1, rollouts.uids)
            split = split_for_dp(rollouts.batch, self.cfg.train.mini_batches, self.engine.ranks.dp,
                                 self.cfg.train.whole_groups)
            stats = {**rollouts.stats, **generation}
        shares, moved = self.scatter.scatter(split, republish=self._republish)
        stats["perf/batch_bytes_lower_bound"] = float(moved.lower_bound)
        return shares, stats, moved

    def _collect(self) -> tuple[Any, dict[str, float]]:
        """The driver's next B groups, packed (None elsewhere); a colocated rank generates
        meanwhile."""
        wait = None
        if self.is_driver:
            wait = lambda: self.controller.next_batch(self.cfg.rollout.batch_size, self.version)  # noqa: E731
        if self.colocated is not None:
            return self.colocated.collect(wait)
        return (self._wait_for_batch() if wait else None), {}

    def _wait_for_batch(self) -> Any:
        """The driver's wait for its batch, in slices of :data:`POLL_S`: between them, a
        rollout shard with no server in rotation while restarted servers wait for weights
        is ended by a republish of the current version, which every rank joins
        (:mod:`realscale.publish.outage`; the others wait in the batch scatter's step 0).
        Time without a server in rotation does not count towards the batch limit."""
        waited = 0.0
        while True:
            t0 = time.monotonic()
            batch = self.controller.next_batch(self.cfg.rollout.batch_size, self.version, poll_s=POLL_S,
                                               waited_s=waited)
            if batch is not None:
                return batch
            verdict = self.outage.check(self.controller.rotation())  # ServersGone when none can come back
            if verdict.action == REPUBLISH:
                self.scatter.order_republish()
                self._republish()
                waited = 0.0
            elif verdict.action == NONE:
                waited += time.monotonic() - t0

    def _republish(self) -> None:
        """Every rank: the current weights again, under the same version (no step was
        taken), to the servers the launcher restarted; they join the rotation."""
        start = time.perf_counter()
        self.publisher.publish(self.engine, self.version)
        if self.is_driver:
            print(f"realscale: republished weight version {self.version} in {time.perf_counter() - start:.1f} s; "
                  "generation goes on", flush=True)

    def _log(self, stats: dict[str, float]) -> None:
        if self.logger is None or self.step % self.cfg.run.log_every:
            return
        ctl = self.controller.stats()
        stats.update({f"rollout_ctl/{k}": v for k, v in ctl.items() if isinstance(v, (int, float))})
        # the most requests in flight at once during the step, in all and on one server (their
        # caps: the staleness rule's capacity, and 2 x generate.max_running_requests per server)
        stats.update({"rollout/inflight": ctl["inflight"], "rollout/inflight_server_max": ctl["inflight_server_max"],
                      "rollout/servers_alive": ctl["servers_in_rotation"], "rollout/lost_requests": ctl["failures"],
                      "rollout/server_restarts": sum(e.restarts for e in read_roster(roster_path(self.out_dir))),
                      "rollout/republishes": float(self.outage.republishes if self.outage is not None else 0)})
        stats.update({f"rollout_ctl/rejected_{why}": n for why, n in ctl["rejected_by_reason"].items()})
        stats.update(self.controller.reward_pool_stats())  # code reward: runs by reason, sandbox_weakened
        stats.update(disk_usage(self.out_dir))
        self.logger.log(self.step, stats)

    def _checkpoint_due(self) -> bool:
        every = self.cfg.run.checkpoint_every
        return bool(every and self.step % every == 0) or self.step == self.cfg.run.total_steps

    def save(self) -> None:
        extra: dict[str, Any] = {"step": self.step, "version": self.version}
        if self.is_driver:
            extra["controller"] = self.controller.state_dict()
        self.checkpoints.save(self.engine, self.step, extra, critic=self.critic)

    def _export_due(self) -> None:
        """An HF snapshot of this step (``run.export_every``; the last step's is the final export)."""
        every = self.cfg.run.export_every
        if every and self.step % every == 0 and self.step < self.cfg.run.total_steps:
            export_final(self.engine, self.out_dir, self.step, export_dir(self.out_dir, self.step))

    def _stop_requested(self) -> bool:
        """Has the launcher asked the run to stop? The driver reads the request; every
        rank gets its answer, so all stop after the same step."""
        holder = [self.is_driver and stop_reason(self.out_dir) is not None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(holder, src=0)
        return bool(holder[0])

    def close(self) -> None:
        if self.is_driver and self.controller is not None:
            hist = self.controller.stats()["staleness_hist"]
            with open(os.path.join(self.out_dir, "staleness_hist.json"), "w", encoding="utf-8") as fh:
                json.dump({str(k): v for k, v in hist.items()}, fh)
            self.controller.stop()
        self.publisher.close()
        if self.logger is not None:
            self.logger.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_main(cfg_dict: dict[str, Any], model_dir: str, server_urls: list[str], out_dir: str) -> None:
    """One trainer rank from start to finish (what the launcher starts)."""
    Trainer(config_from_dict(cfg_dict), model_dir, server_urls, out_dir).train()

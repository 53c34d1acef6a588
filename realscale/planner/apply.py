"""A plan becomes a run: the roles of a plan YAML set the layouts the runtime uses.

``parallel.plan`` names a plan (``realscale plan ... --out plan.yaml``); :func:`apply_plan`
places every role the runtime runs:

- ``actor_train`` -> ``parallel.dp / tp / pp / ep`` (the Megatron trainer ranks; ep > 1
  only for a mixture-of-experts model, which with tp > 1 also needs
  ``parallel.sequence_parallel``: Megatron's MoE layer refuses to train without it, so a
  plan that would reach that refusal is refused here);
- ``actor_gen`` -> ``generate.num_servers`` (its dp) and ``generate.tp`` (ranks per
  server; its pp must be 1);
- ``critic_train`` (PPO with GAE) trains beside the actor (same ranks, same layout), so a
  plan that puts it elsewhere is refused rather than silently ignored;
- ``actor_train``'s recomputation -> ``train.recompute`` when that is ``auto`` (the plan's
  memory holds only with it; without a plan ``auto`` is none);
- the plan's ``mode`` -> ``parallel.mode``; a colocated plan runs synchronously, so it
  also sets ``rollout.max_staleness`` to 0 (saying so when the recipe had another value).

It runs in the supervisor before any process starts, so a plan the runtime cannot
execute (:mod:`realscale.planner.validate`) is refused with a one-line
:class:`~realscale.config.ConfigError`; whether the ranks fit the machine or the Slurm
allocation is checked by the launcher's backend (``prepare`` / ``placement``) through
:func:`realscale.planner.validate.check_capacity`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import yaml

from realscale.config import ConfigError
from realscale.parallel.mesh import LayoutError
from realscale.planner.plan import Plan
from realscale.planner.validate import check_colocated, check_plan, policy_spec

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.parallel.model_spec import ModelSpec
    from realscale.planner.plan import Plan


def load_plan(cfg: "Config") -> "Plan":
    """The plan ``parallel.plan`` names, or a one-line ConfigError."""

    path = cfg.parallel.plan
    if not os.path.exists(path):
        raise ConfigError(f"parallel.plan: file not found: {path}")
    try:
        return Plan.load(path)
    except (LayoutError, KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"parallel.plan: {path}: {exc}") from None


def apply_plan(cfg: "Config") -> "Config":
    """``parallel.plan`` set: check the plan, then take the trainer's (dp, tp, pp, ep), the
    servers' count and tp, and the mode from it. A colocated run, planned or not, is
    checked here too (:func:`realscale.planner.validate.check_colocated`)."""

    if cfg.parallel.plan:
        plan, spec = _checked_plan(cfg)
        s, g = plan.roles["actor_train"].strategy, plan.roles["actor_gen"].strategy
        cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep = s.dp, s.tp, s.pp, s.ep
        cfg.generate.num_servers, cfg.generate.tp = g.dp, g.tp
        if cfg.parallel.sequence_parallel and s.tp == 1:
            cfg.parallel.sequence_parallel = False  # nothing to split the sequence over
        if spec is not None and spec.num_experts and s.tp > 1 and not cfg.parallel.sequence_parallel:
            raise ConfigError(f"parallel.plan {cfg.parallel.plan}: actor_train {s} trains a mixture-of-experts "
                              "model with tp > 1, which needs parallel.sequence_parallel=true (megatron's MoE layer)")
        cfg.parallel.mode = plan.mode
        if cfg.train.recompute == "auto":
            cfg.train.recompute = plan.roles["actor_train"].recompute
        if plan.mode == "colocated" and cfg.rollout.max_staleness:
            print(f"realscale: colocated plan {cfg.parallel.plan}: generation and training take turns, so the run "
                  f"is synchronous (rollout.max_staleness {cfg.rollout.max_staleness} -> 0)", flush=True)
            cfg.rollout.max_staleness = 0
    elif cfg.train.recompute == "auto":
        cfg.train.recompute = "none"
    if cfg.parallel.mode == "colocated":
        where = f"parallel.plan {cfg.parallel.plan}: a colocated plan" if cfg.parallel.plan else "parallel.mode=colocated"
        check_colocated(cfg, where)
    return cfg


def _checked_plan(cfg: "Config") -> "tuple[Plan, ModelSpec | None]":
    plan = load_plan(cfg)
    try:
        spec = policy_spec(cfg)
    except LayoutError as exc:
        raise ConfigError(f"parallel.plan: the policy model: {exc}") from None
    check_plan(plan, spec, f"parallel.plan {cfg.parallel.plan}")
    return plan, spec

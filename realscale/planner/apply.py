"""A plan becomes a run: the roles of a plan YAML set the layouts the runtime uses.

``parallel.plan`` names a plan (``realscale plan ... --out plan.yaml``); :func:`apply_plan`
copies its ``actor_train`` strategy into ``parallel.dp/tp/pp``. It runs in the supervisor
before any process starts, so a plan the runtime cannot execute is refused with a
one-line :class:`~realscale.config.ConfigError`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from realscale.config import ConfigError

if TYPE_CHECKING:
    from realscale.config import Config


def apply_plan(cfg: "Config") -> "Config":
    """``parallel.plan`` set: take the trainer's (dp, tp, pp) from the plan's actor_train role."""
    if not cfg.parallel.plan:
        return cfg
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

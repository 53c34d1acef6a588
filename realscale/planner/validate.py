"""Can the runtime execute this plan, here? Checked before any process starts.

A plan (``realscale plan ... --out plan.yaml``) places each role on a mesh with a (dp,
tp, pp) strategy. The runtime runs two roles, ``actor_train`` (the Megatron trainer ranks)
and ``actor_gen`` (``dp`` generation replicas of ``tp`` ranks each), in either mode:
disaggregated (AReaL: the replicas are generation servers on devices of their own) or
colocated (ReaL: the trainer ranks themselves generate between updates,
:mod:`realscale.serve.colocated`). :func:`check_plan` refuses, in one line naming what
is wrong:

- a role the runtime does not place yet (roles other than the actor's, the critic's and
  the reference's);
- a critic or reference role off the actor's trainer devices: both run on the trainer
  ranks in the actor's layout (``ref_inf``: any strategy, on some or all of
  ``actor_train``'s devices; the runtime computes reference log-probs on all of them, in
  the training layout);
- meshes that overlap in disaggregated mode; in colocated mode, an ``actor_gen`` mesh
  other than ``actor_train``'s (every trainer rank is one generation rank);
- a layout the model cannot take (``ModelSpec.check_strategy``: tp must divide the
  heads, key/value groups and every split dimension, including the vocabulary padded to
  a multiple of 128; pp at most the layers, and Megatron needs equal stages); generation
  with pipeline stages (servers are dp x tp);

:func:`check_capacity` refuses more ranks than there are places to run them. **The rule**
(one function, used by the local launcher and by the Slurm backend): a run needs
``parallel.dp*tp*pp`` trainer ranks plus ``generate.num_servers * generate.tp`` server
ranks (none in colocated mode: the trainer ranks generate), each on a device of its own:

- on GPUs, one GPU per rank: the visible GPUs of this machine, or the job's
  ``nodes x launch.gpus_per_node`` under Slurm; never oversubscribed;
- on CPU, one core per rank: ``os.cpu_count()`` here, or the allocation's CPUs under
  Slurm; ``launch.oversubscribe=true`` runs anyway (slow, but how a 2-core machine runs a
  4-rank plan in tests).

It applies to runs with a plan: a plan is a placement, and one that does not fit is not
the placement that will run. Without a plan the launcher starts what the config asks.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from realscale.config import ConfigError
from realscale.models.tiny import BUILTIN, SPECIAL_TOKENS, resolve_model_path
from realscale.parallel.device import cuda_usable
from realscale.parallel.mesh import LayoutError
from realscale.parallel.model_spec import known_model, spec_from_hf_config, transformer_spec

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.parallel.model_spec import ModelSpec
    from realscale.planner.plan import Plan

RUNTIME_ROLES = ("actor_train", "actor_gen")
PLAN_MODES = ("disaggregated", "colocated")
CRITIC_ROLES = ("critic_train", "critic_inf")  # PPO with GAE: optional, on the actor's ranks
REF_ROLE = "ref_inf"  # the KL penalty's reference (algo.kl_coef > 0): optional, on the actor's devices


def check_plan(plan: "Plan", spec: "ModelSpec | None", where: str) -> None:
    """Raise :class:`ConfigError` unless the runtime can execute ``plan`` (``spec``: the
    policy model's, None when it cannot be known before the run starts)."""
    if plan.mode not in PLAN_MODES:
        raise ConfigError(f"{where}: mode {plan.mode!r} is not one of {', '.join(PLAN_MODES)}")
    for role in RUNTIME_ROLES:
        if role not in plan.roles:
            raise ConfigError(f"{where}: no {role} role (roles: {', '.join(plan.roles)})")
    extra = [r for r in plan.roles if r not in (*RUNTIME_ROLES, *CRITIC_ROLES, REF_ROLE)]
    if extra:
        raise ConfigError(f"{where}: role {extra[0]} is not placed by the runtime yet (only actor_train, "
                          "actor_gen, ref_inf and the critic's)")
    train, gen = plan.roles["actor_train"], plan.roles["actor_gen"]
    # The critic's engine lives on the actor's trainer ranks in the actor's layout: critic_train
    # must be placed exactly there; critic_inf on the same devices (the runtime computes values
    # in the training layout, whatever inference layout the planner costed).
    for name in CRITIC_ROLES:
        critic = plan.roles.get(name)
        same = critic is None or (critic.mesh == train.mesh
                                  and (name == "critic_inf" or critic.strategy == train.strategy))
        if not same:
            raise ConfigError(f"{where}: {name} ({critic.strategy} on {critic.mesh}) must share actor_train's "
                              f"placement ({train.strategy} on {train.mesh}): the critic runs on the actor's ranks")
    ref = plan.roles.get(REF_ROLE)  # on actor_train's devices (all or some): the runtime uses all of them
    if ref is not None and not train.mesh.start <= ref.mesh.start < ref.mesh.end <= train.mesh.end:
        raise ConfigError(f"{where}: ref_inf on {ref.mesh} must be on actor_train's devices ({train.mesh}): the "
                          "reference runs on the trainer ranks in the actor's layout (its own mesh is not implemented)")
    if plan.mode == "colocated" and gen.mesh != train.mesh:
        raise ConfigError(f"{where}: a colocated plan generates on actor_train's devices (each trainer rank is "
                          f"one generation rank): actor_gen {gen.mesh} must equal actor_train {train.mesh}")
    if plan.mode == "disaggregated" and train.mesh.overlaps(gen.mesh):
        raise ConfigError(f"{where}: actor_train {train.mesh} and actor_gen {gen.mesh} overlap; a disaggregated "
                          "plan gives each role its own devices")
    if gen.strategy.pp != 1:
        raise ConfigError(f"{where}: actor_gen {gen.strategy} has pipeline stages; generation servers are dp x tp "
                          "(pp must be 1)")
    if spec is not None:
        _check_model(spec, "actor_train", train.strategy, where)
        _check_model(spec, "actor_gen", gen.strategy, where)


def _check_model(spec: "ModelSpec", role: str, strategy: object, where: str) -> None:
    try:
        spec.check_strategy(strategy)  # type: ignore[arg-type]
    except LayoutError as exc:
        raise ConfigError(f"{where}: {role} {strategy}: {exc}") from None
    pp = strategy.pp  # type: ignore[attr-defined]
    if spec.n_layers % pp:
        raise ConfigError(f"{where}: {role} {strategy}: pp={pp} does not divide the model's {spec.n_layers} layers "
                          "(Megatron needs equal pipeline stages)")


def check_colocated(cfg: "Config", where: str) -> None:
    """A colocated run (after its plan, if any, was applied): the trainer ranks generate with
    the embedded decoder, every rank in the generation layout, synchronously."""
    g, world = cfg.generate, cfg.parallel.world_size
    problem = ""
    if g.backend != "embedded":
        problem = f"the trainer ranks generate with the embedded decoder; generate.backend={g.backend} runs servers"
    elif g.num_servers * g.tp != world:
        problem = (f"generate.num_servers x generate.tp = {g.num_servers} x {g.tp} must equal the trainer's "
                   f"{world} ranks (each trainer rank is one generation rank)")
    elif cfg.rollout.max_staleness != 0:
        problem = (f"generation and training take turns, so a step is synchronous: set rollout.max_staleness=0 "
                   f"(got {cfg.rollout.max_staleness})")
    if problem:
        raise ConfigError(f"{where}: {problem}")


def ranks_needed(cfg: "Config") -> tuple[int, int]:
    """(trainer ranks, generation-server ranks) of a run; colocated runs have no servers."""
    if cfg.parallel.mode == "colocated":
        return cfg.parallel.world_size, 0
    return cfg.parallel.world_size, cfg.generate.num_servers * cfg.generate.tp


def check_capacity(cfg: "Config", slots: int, unit: str, where: str, gpus: bool) -> None:
    """The rule of the module docstring: every rank on a ``unit`` of its own (``slots``
    of them); CPU slots may be oversubscribed with ``launch.oversubscribe``."""
    trainer, servers = ranks_needed(cfg)
    need = trainer + servers
    if need <= slots or (not gpus and cfg.launch.oversubscribe):
        return
    hint = "" if gpus else "; set launch.oversubscribe=true to run anyway"
    raise ConfigError(f"{where}: the plan needs {need} ranks ({trainer} trainer + {servers} generation-server), "
                      f"there are {slots} {unit}{hint}")


def local_slots() -> tuple[int, str, bool]:
    """(slots, unit, gpus) of this machine: visible GPUs, else CPU cores."""

    if cuda_usable():
        import torch

        return torch.cuda.device_count(), "GPUs on this machine", True
    return os.cpu_count() or 1, "CPU cores on this machine", False


def policy_spec(cfg: "Config") -> "ModelSpec | None":
    """The policy model's spec as far as it is known before the run: its config.json, a
    built-in tiny model, the ``sft`` section's fresh model, or ``launch.model_size``."""

    path = cfg.model.path
    if path == "sft":
        if not cfg.sft.base_model:
            s = cfg.sft  # a fresh tiny Qwen2 (realscale.sft.build_base_model); byte tokenizer + specials
            return transformer_spec(hidden=s.hidden_size, n_layers=s.num_layers, n_heads=s.num_heads,
                                    n_kv_heads=s.num_kv_heads, ffn=s.intermediate_size,
                                    vocab=256 + len(SPECIAL_TOKENS), tie_embeddings=True)
        path = cfg.sft.base_model

    if path in BUILTIN:
        path = resolve_model_path(path)  # built once into the cache
    config_json = os.path.join(path, "config.json")
    if os.path.isfile(config_json):
        with open(config_json, encoding="utf-8") as fh:
            return spec_from_hf_config(json.load(fh))
    if cfg.launch.model_size:
        return known_model(cfg.launch.model_size)
    return None

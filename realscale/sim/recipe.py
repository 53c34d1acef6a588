"""A :class:`~realscale.sim.build.Scenario` from a recipe (and a plan): what ``realscale simulate`` runs.

- GPU recipes (``launch.gpus_per_node > 0``): the layout is the plan's (``parallel.plan``,
  a plan file given on the command line, or the one ``realscale sweep`` would render for
  ``launch.nodes``, re-planned for ``--gpus``); the servers' KV budget comes from the cost
  model; the weight update from the resharder.
- CPU recipes: ``generate.num_servers`` embedded servers (``max_running_requests`` slots)
  and a trainer of ``parallel.dp/tp/pp``, on a measured CPU profile.

The workload is the recipe's (prompts per step, answers per prompt, answer cap, η,
``max_concurrent``, micro-batch budget, mini-batches, pause mode); answer lengths and the
filter's acceptance are not in a recipe and come from options (defaults: the lengths
calibrated on the AReaL figures for GPU recipes, the task's own answers for ``task:``
sources).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import numpy as np

from realscale.data.tokens import prompt_ids
from realscale.launcher.render import model_spec_for
from realscale.models.tiny import BUILTIN, SPECIAL_TOKENS, byte_alphabet, resolve_model_path
from realscale.models.tokenizer import load_tokenizer
from realscale.parallel.mesh import Strategy
from realscale.parallel.model_spec import ModelSpec, spec_from_hf_config, transformer_spec
from realscale.planner.hardware import HardwareProfile
from realscale.sim.build import SGLANG_ABORT_PAUSE_S, RunLayout, Scenario, weight_path_for
from realscale.sim.workload import (
    AcceptAll,
    AcceptFraction,
    Histogram,
    LengthDist,
    Lognormal,
    TaskMix,
    Workload,
    WorkloadError,
)
from realscale.tasks.arith import task_from_config

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.planner.plan import Plan

CALIBRATION_JSON = os.path.join("benchmarks", "results", "sim_calibration.json")


def cpu_model_spec(cfg: Config) -> ModelSpec:
    """The recipe's model: a local HF directory or built-in tiny model, or (``sft``) the
    warm start's architecture from the ``sft`` section (a tiny Qwen2 over the byte
    tokenizer, as ``realscale sft`` builds it; nothing is built here)."""

    itemsize = 4 if cfg.model.dtype == "float32" else 2
    path = cfg.model.path
    if path in BUILTIN or os.path.isdir(path):
        with open(os.path.join(resolve_model_path(path), "config.json"), encoding="utf-8") as fh:
            return spec_from_hf_config(json.load(fh), itemsize=itemsize)
    s = cfg.sft
    vocab = -(-(len(SPECIAL_TOKENS) + len(byte_alphabet())) // 8) * 8  # the tokenizer's, rounded up to 8
    return transformer_spec(s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size, vocab,
                            tie_embeddings=True, qkv_bias=True, itemsize=itemsize)


def task_prompt_len(cfg: Config) -> int:
    """Mean prompt tokens of a ``task:`` source (chat template included, tiny byte tokenizer)."""

    tok = load_tokenizer(resolve_model_path("tiny-qwen2"))
    problems = task_from_config(cfg.data).split("train")[:200]
    return round(float(np.mean([len(prompt_ids(tok, p.prompt)) for p in problems])))


def task_mix(cfg: Config, worked: float | None = None) -> TaskMix:
    """The task's answers (one token per character, plus end-of-sequence), worked out with
    probability ``worked`` (default: the warm start's ``data.task_worked_fraction``)."""

    problems = task_from_config(cfg.data).split("train")
    w = cfg.data.task_worked_fraction if worked is None else worked
    return TaskMix(tuple(len(p.answer) + 1 for p in problems), tuple(len(p.worked()) + 1 for p in problems), w)


def parse_lengths(text: str, cfg: Config) -> LengthDist:
    """``lognormal:MEDIAN:SIGMA``, ``hist:FILE.json`` ({"lengths": [...], "weights": [...]}),
    ``task`` or ``task:WORKED`` (a ``task:`` recipe's own answers), ``calibrated`` (the
    AReaL-calibrated lognormal)."""
    kind, _, rest = text.partition(":")
    try:
        if kind == "lognormal":
            median, sigma = (float(x) for x in rest.split(":"))
            return Lognormal(median, sigma)
        if kind == "hist":
            with open(rest, encoding="utf-8") as fh:
                data = json.load(fh)
            return Histogram(tuple(int(x) for x in data["lengths"]), tuple(float(x) for x in data["weights"]))
        if kind == "task":
            if not cfg.data.source.startswith("task:"):
                raise WorkloadError(f"--lengths task needs a task: data source, the recipe has {cfg.data.source!r}")
            return task_mix(cfg, float(rest) if rest else None)
        if kind == "calibrated":
            return calibrated_lengths()
    except (ValueError, KeyError, OSError) as exc:
        raise WorkloadError(f"--lengths {text}: {exc}") from None
    raise WorkloadError(f"--lengths {text}: expected lognormal:MEDIAN:SIGMA, hist:FILE.json, task[:WORKED] "
                        "or calibrated")


def calibrated_lengths(path: str = CALIBRATION_JSON) -> Lognormal:
    if not os.path.isfile(path):
        raise WorkloadError(f"no calibration at {path}: run `python benchmarks/sim_scaling.py calibrate` or pass "
                            "--lengths lognormal:MEDIAN:SIGMA")
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)["lengths"]
    return Lognormal(float(data["median"]), float(data["sigma"]))


def layout_from_plan(plan: Plan, gpus_per_node: int) -> RunLayout:
    gen, train = plan.roles["actor_gen"].strategy, plan.roles["actor_train"].strategy
    gpn = plan.cluster.gpus_per_node if plan.cluster is not None else gpus_per_node
    return RunLayout(gen.tp, gen.dp, train, colocated=plan.mode == "colocated", gpus_per_node=gpn)


def scenario_from_config(cfg: Config, hw: HardwareProfile, *, plan: Plan | None = None, lengths: LengthDist | None = None,
                         accept: float | None = None) -> Scenario:
    """The recipe's run under ``hw`` (a GPU recipe needs ``plan``; see the module docstring)."""
    gpu_job = cfg.launch.gpus_per_node > 0
    if gpu_job:
        if plan is None:
            raise WorkloadError("a GPU recipe needs a plan (parallel.plan, --plan, or --gpus)")
        spec = model_spec_for(cfg)
        layout = layout_from_plan(plan, cfg.launch.gpus_per_node)
        prompt_len = cfg.data.max_prompt_tokens
    else:
        spec = cpu_model_spec(cfg)
        p = cfg.parallel
        layout = RunLayout(1, cfg.generate.num_servers, Strategy(p.dp, p.tp, p.pp, p.ep),
                           gpus_per_node=os.cpu_count() or 1)
        prompt_len = task_prompt_len(cfg) if cfg.data.source.startswith("task:") else cfg.data.max_prompt_tokens
    if lengths is None:
        lengths = task_mix(cfg) if cfg.data.source.startswith("task:") else calibrated_lengths()
    w = Workload(cfg.rollout.batch_size, cfg.rollout.n_samples, prompt_len, cfg.generate.max_new_tokens, lengths,
                 AcceptFraction(accept) if accept is not None else AcceptAll())
    return Scenario(spec, hw, layout, w, cfg.rollout.max_staleness, train_mb_tokens=cfg.train.max_tokens_per_micro_batch,
                    minibatches=cfg.train.mini_batches, max_running=cfg.generate.max_running_requests,
                    kv_budget=gpu_job, max_concurrent=cfg.rollout.max_concurrent,
                    interrupt="in_place" if cfg.generate.pause_mode == "in_place" else "recompute",
                    ref=cfg.algo.kl_coef > 0, padded_attention=cfg.generate.backend == "embedded",
                    pause_floor_s=SGLANG_ABORT_PAUSE_S if (cfg.generate.backend == "sglang"
                                                          and cfg.generate.pause_mode == "abort") else 0.0,
                    weight_path=weight_path_for(cfg.generate.backend, cfg.generate.vllm_weight_engine))

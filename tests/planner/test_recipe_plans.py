"""Every shipped GPU recipe's plan holds with the engine's real settings.

The plan's memory estimate assumes a training setup (activation recomputation, sequence
parallelism, chunked log-probs, bf16, the distributed optimizer, equal pipeline stages);
these tests build the engine's configuration from the recipe + plan exactly as a rank
does (``apply_plan`` then ``EngineConfig.from_config``) and fail when the plan relies on
something the engine would not turn on, or when its memory does not fit with what the
engine does turn on."""

from __future__ import annotations

import glob
import math
import os

import pytest
import yaml

from realscale.config import load_config
from realscale.launcher.render import model_spec_for, plan_for, problem_for
from realscale.models.family import arch_from_hf
from realscale.models.megatron_gpt import transformer_config
from realscale.planner import cost as C
from realscale.planner.hardware import get_gpu
from realscale.planner.plan import Plan
from realscale.train.engine import EngineConfig
from realscale.planner.apply import apply_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_RECIPES = sorted(p for p in glob.glob(os.path.join(REPO, "configs", "*.yaml"))
                     if load_config(p).launch.gpus_per_node > 0)
with open(os.path.join(REPO, "configs", "sweeps", "areal_sizes.yaml"), encoding="utf-8") as _fh:
    SHIPPED = [(os.path.join(REPO, job["recipe"]), os.path.join(REPO, "launch", "slurm", "plans", f"{name}.yaml"))
               for name, job in yaml.safe_load(_fh)["jobs"].items()]
# recipes whose plan sits beside them (configs/plans/<recipe>.yaml) and names it in parallel.plan
BESIDE = [(os.path.join(REPO, "configs", f"{name}.yaml"), os.path.join(REPO, "configs", "plans", f"{name}.yaml"))
          for name in ("qwen3_30b_a3b_math",)]
SHIPPED += BESIDE


def _hf_config(spec) -> dict:  # noqa: ANN001 - ModelSpec
    hd = spec.meta.get("head_dim", spec.hidden // spec.n_heads)
    moe = {}
    if spec.num_experts:
        moe = {"model_type": "qwen3_moe", "num_experts": spec.num_experts, "num_experts_per_tok": spec.meta["moe_topk"],
               "moe_intermediate_size": spec.meta["moe_ffn"], "norm_topk_prob": True}
    return {"model_type": "qwen2", "vocab_size": spec.vocab, "hidden_size": spec.hidden,
            "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
            "num_key_value_heads": spec.n_kv_heads, "head_dim": hd, "intermediate_size": spec.ffn,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": bool(spec.meta.get("tie_embeddings")),
            "max_position_embeddings": 32768, **moe}


def engine_memory_gb(recipe: str, plan_path: str, overrides: tuple[str, ...] = ()) -> tuple[float, float, str]:
    """(memory per training GPU with the engine's settings, usable HBM, engine recompute)."""
    cfg = apply_plan(load_config(recipe, [f"parallel.plan={plan_path}", *overrides]))
    ec = EngineConfig.from_config(cfg, cfg.model.path)
    plan = Plan.load(plan_path)
    s = plan.roles["actor_train"].strategy
    assert ec.dtype == "bfloat16" and ec.distributed_optimizer, "the memory model assumes bf16 + distributed optimizer"
    spec = model_spec_for(cfg)
    # the engine builds this config on every rank: equal stages, tp dividing the heads, a
    # MoE model's ep dividing its experts and sequence parallelism under tp
    assert ec.ep == s.ep
    tc = transformer_config(arch_from_hf(_hf_config(spec)), tp=ec.tp, pp=ec.pp,
                            sequence_parallel=ec.sequence_parallel, dtype=ec.dtype, recompute=ec.recompute, ep=ec.ep)
    assert tc.recompute_granularity == (None if ec.recompute == "none" else ec.recompute)
    w = problem_for(cfg).workload
    w = C.Workload(**{**w.__dict__, "sequence_parallel": ec.sequence_parallel,
                      "logprob_chunk_tokens": ec.logprob_chunk_tokens,
                      "train_mb_tokens": ec.max_tokens_per_micro_batch})
    usable = C.usable_bytes(get_gpu(cfg.launch.gpu).hbm_gb) / C.GB
    return C.train_memory_bytes(spec, s, w, ec.recompute) / C.GB, usable, ec.recompute


@pytest.mark.parametrize("recipe,plan_path", SHIPPED, ids=[os.path.basename(p) for _, p in SHIPPED])
def test_shipped_plan_holds_with_the_engine_settings(recipe: str, plan_path: str) -> None:
    """The engine enables the recomputation the plan assumes, and the memory fits."""
    mem, usable, recompute = engine_memory_gb(recipe, plan_path)
    assert recompute == Plan.load(plan_path).roles["actor_train"].recompute
    assert mem <= usable, f"{plan_path}: {mem:.1f} GB per training GPU > {usable:.1f} GB usable"
    assert mem == pytest.approx(Plan.load(plan_path).roles["actor_train"].mem_gb, rel=1e-3)


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=os.path.basename)
def test_every_gpu_recipe_gets_a_plan_that_fits(recipe: str, tmp_path) -> None:
    """Recipes outside the sweep too: a fresh plan whose memory holds with the engine's settings."""
    cfg = load_config(recipe)
    path = tmp_path / "plan.yaml"
    path.write_text(plan_for(cfg).to_yaml())
    mem, usable, _ = engine_memory_gb(recipe, str(path))
    assert mem <= usable


def test_a_plan_that_needs_recompute_fails_without_it() -> None:
    """The check can fail: a plan planned with full recomputation, run with train.recompute=none,
    does not fit (this is what the engine did before it read the plan)."""
    needing = [(r, p) for r, p in SHIPPED if Plan.load(p).roles["actor_train"].recompute == "full"]
    assert needing, "no shipped plan needs recomputation: the test below checks nothing"
    for recipe, plan_path in needing:
        mem, usable, rc = engine_memory_gb(recipe, plan_path, ("train.recompute=none",))
        assert rc == "none" and mem > usable and math.isfinite(mem)


@pytest.mark.parametrize("recipe,plan_path", BESIDE, ids=[os.path.basename(p) for _, p in BESIDE])
def test_a_plan_beside_its_recipe_is_what_the_sweep_renders(recipe: str, plan_path: str) -> None:
    """The checked-in plan is today's render (``realscale sweep`` on a sweep naming the
    recipe writes the same bytes), and the recipe's own trainer layout is the plan's, so
    the recipe says what will run even before the plan is applied."""
    cfg = load_config(recipe)
    with open(plan_path, encoding="utf-8") as fh:
        assert plan_for(cfg).to_yaml() == fh.read(), f"{plan_path} drifted: re-render it from {recipe}"
    assert os.path.join(REPO, cfg.parallel.plan) == plan_path
    s = Plan.load(plan_path).roles["actor_train"].strategy
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.ep) == (s.dp, s.tp, s.pp, s.ep)
    assert p.sequence_parallel == (s.tp > 1)  # megatron's MoE layer needs it under tp

"""The training engine: log-probs, PPO train steps and checkpoints, N ranks vs one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import engine_cases as cases
from realscale.models.tiny import resolve_model_path
from realscale.parallel.spawn import run_distributed

pytestmark = pytest.mark.multiproc

STEPS = 2
LAYOUTS_2 = {"tp2": (2, 1, False), "tp2-sp": (2, 1, True), "pp2": (1, 2, False), "dp2": (1, 1, False)}


@pytest.fixture(scope="module")
def model() -> str:
    return resolve_model_path("tiny-qwen2")


@pytest.fixture(scope="module")
def single(model: str) -> dict[str, Any]:
    base, one_mb, lp = run_distributed(cases.run_many, 1, [
        ("train_steps", (model, 1, 1, False, STEPS)),
        ("train_steps", (model, 1, 1, False, STEPS, 10_000)),  # everything in one micro-batch
        ("logprob_check", (model, 1, 1)),
    ], timeout=400)[0]
    return {"base": base, "one_mb": one_mb, "lp": lp}


@pytest.fixture(scope="module")
def shared(model: str) -> dict[str, Any]:
    """Grouped sequences (prompts with several answers) trained with and without shared
    prefixes, in one micro-batch and under a budget that splits them."""
    jobs = [("train_steps", (model, 1, 1, False, STEPS, budget, True, True, share))  # dist_opt, grouped
            for budget in (10_000, 40) for share in (True, False)]
    jobs.append(("logprob_check", (model, 1, 1, True)))
    *runs, lp = run_distributed(cases.run_many, 1, jobs, timeout=400)[0]
    return {"one_mb": runs[0:2], "split": runs[2:4], "lp": lp}


@pytest.fixture(scope="module")
def two_ranks(model: str) -> dict[str, Any]:
    names = list(LAYOUTS_2)
    jobs = [("train_steps", (model, *LAYOUTS_2[n], STEPS)) for n in names]
    jobs += [("train_steps", (model, 2, 1, True, STEPS, 10_000, True, True, True)),  # grouped, shared, tp2-sp
             ("train_steps", (model, 1, 1, False, STEPS, 10_000, True, True, True))]  # ... dp2
    per_rank = run_distributed(cases.run_many, 2, jobs, timeout=500)
    return {**{n: per_rank[0][i] for i, n in enumerate(names)},
            "shared-tp2-sp": per_rank[0][-2], "shared-dp2": per_rank[0][-1]}


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    for sa, sb in zip(a["stats"], b["stats"]):
        assert abs(sa["loss"] - sb["loss"]) <= 1e-5 * abs(sa["loss"]), (sa["loss"], sb["loss"])
        assert abs(sa["grad_norm"] - sb["grad_norm"]) <= 1e-5 * sa["grad_norm"], (sa["grad_norm"], sb["grad_norm"])
    assert torch.allclose(a["lp1"], b["lp1"], atol=1e-4, rtol=0)


def test_logprobs_match_hf(single: dict[str, Any]) -> None:
    assert single["lp"]["lp"] < 1e-4
    assert single["lp"]["ent"] < 1e-4


def test_shared_prefixes_train_exactly_as_unshared(shared: dict[str, Any]) -> None:
    """The same grouped batch, its prompts run once or once per sample: the same losses,
    gradient norms and log-probs after the steps; and the shared run ran fewer positions."""
    for with_share, without in (shared["one_mb"], shared["split"]):
        assert with_share["stats"][0]["row_fraction"] < 0.9 and without["stats"][0]["row_fraction"] == 1.0
        _same_run(without, with_share)
    assert shared["one_mb"][0]["stats"][0]["row_fraction"] < 0.5  # 9 sequences of 2 prompts
    assert shared["split"][0]["stats"][0]["micro_batches"] > 1


def test_shared_prefix_logprobs_match_hf(shared: dict[str, Any]) -> None:
    """Per-row RoPE positions and the layout's attention, against HF's model run on each
    sequence alone."""
    assert shared["lp"]["lp"] < 1e-4 and shared["lp"]["ent"] < 1e-4


def test_training_changes_the_policy(single: dict[str, Any]) -> None:
    base = single["base"]
    assert all(s["grad_norm"] > 0 and s["update_ok"] == 1.0 for s in base["stats"])
    assert base["stats"][0]["micro_batches"] > 1  # the budget forced several micro-batches
    assert (base["lp1"] - base["lp0"]).abs().max() > 1e-3


def test_loss_is_exact_whatever_the_packing(single: dict[str, Any]) -> None:
    assert single["one_mb"]["stats"][0]["micro_batches"] == 1
    _same_run(single["base"], single["one_mb"])


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_rank_layouts_match_single_process(single: dict, two_ranks: dict, name: str) -> None:
    _same_run(single["base"], two_ranks[name])


@pytest.mark.parametrize("name", ["shared-tp2-sp", "shared-dp2"])
def test_shared_prefixes_on_two_ranks_match_one_unshared(shared: dict, two_ranks: dict, name: str) -> None:
    """Shared prefixes under tensor and sequence parallelism (the row split over TP ranks)
    and under data parallelism train as one unshared process does."""
    assert two_ranks[name]["stats"][0]["row_fraction"] < 1.0
    _same_run(shared["one_mb"][1], two_ranks[name])


def test_tp2_pp2_matches_single_process(model: str, single: dict[str, Any]) -> None:
    res, lp = run_distributed(cases.run_many, 4, [("train_steps", (model, 2, 2, False, STEPS)),
                                                  ("logprob_check", (model, 2, 2))], timeout=500)[0]
    _same_run(single["base"], res)
    assert lp["lp"] < 1e-4


def test_checkpoint_at_tp2_resumes_at_tp1_dp2(model: str, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(cases.checkpoint_then_continue, 2, model, 2, 1, ckpt, "save", timeout=400)[0]
    resumed = run_distributed(cases.checkpoint_then_continue, 2, model, 1, 1, ckpt, "load", timeout=400)[0]
    assert resumed["extra"] == {"data_position": 17}
    assert resumed["step_count"] == saved["step_count"] == 5
    for a, b in zip(saved["losses"], resumed["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (saved["losses"], resumed["losses"])
    assert len(set(round(x, 6) for x in saved["losses"])) > 1  # the steps really changed the model

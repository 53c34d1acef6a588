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
def two_ranks(model: str) -> dict[str, Any]:
    names = list(LAYOUTS_2)
    jobs = [("train_steps", (model, *LAYOUTS_2[n], STEPS)) for n in names]
    per_rank = run_distributed(cases.run_many, 2, jobs, timeout=500)
    return {n: per_rank[0][i] for i, n in enumerate(names)}


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    for sa, sb in zip(a["stats"], b["stats"]):
        assert abs(sa["loss"] - sb["loss"]) <= 1e-5 * abs(sa["loss"]), (sa["loss"], sb["loss"])
        assert abs(sa["grad_norm"] - sb["grad_norm"]) <= 1e-5 * sa["grad_norm"], (sa["grad_norm"], sb["grad_norm"])
    assert torch.allclose(a["lp1"], b["lp1"], atol=1e-4, rtol=0)


def test_logprobs_match_hf(single: dict[str, Any]) -> None:
    assert single["lp"]["lp"] < 1e-4
    assert single["lp"]["ent"] < 1e-4


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

"""The reference policy of the KL penalty (realscale/train/reference.py): a large
``algo.kl_coef`` keeps the trained policy closer to it than ``kl_coef = 0`` (exact KL over
the vocabulary, same seed and batches); the logged KL is the loss's KL; the reference
stays frozen and comes back whole after offload; one trainer rank equals two (DP=2,
TP=2 under -m slow) for reference log-probs and the loss with the KL term; a reference of another
architecture is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reference_cases as cases
from realscale.config import ConfigError, load_config
from realscale.models.tiny import resolve_model_path
from realscale.parallel.spawn import run_distributed
from realscale.train.reference import reference_model_dir

STEPS, BIG = 8, 300.0


@pytest.mark.multiproc
def test_a_large_kl_coef_keeps_the_policy_near_the_reference() -> None:
    model = resolve_model_path("tiny-qwen2")
    out = run_distributed(cases.kl_after_steps, 1, model, STEPS, [0.0, BIG], timeout=600)[0]
    free, held = out["kl"][0.0], out["kl"][BIG]
    assert free > 1e-3, out["kl"]  # the policy did move away without the penalty
    assert held < 0.7 * free, out["kl"]  # measured on sequences neither run trained on
    last_free, last_held = out["stats"][0.0][-1], out["stats"][BIG][-1]
    assert last_held["actor/kl_ref"] < last_free["actor/kl_ref"]
    assert "train/kl" not in last_free  # kl_coef = 0: no KL term in the loss
    for s in out["stats"][BIG]:  # one mini-batch: the loss's KL is the measured KL of the step's policy
        assert s["train/kl"] == pytest.approx(s["actor/kl_ref"], rel=1e-4, abs=1e-9)
        assert s["actor/kl_loss"] == pytest.approx(BIG * s["train/kl"])
    assert out["frozen"]
    assert out["bytes_resident"] > 0 and out["bytes_offloaded"] == 0
    assert out["offloaded_refuses"] and out["restored_equal"]


@pytest.mark.multiproc
@pytest.mark.parametrize("tp,dp", [(1, 2), pytest.param(2, 1, marks=pytest.mark.slow)], ids=["dp2", "tp2"])
def test_two_ranks_equal_one_with_the_kl_term(tmp_path: Path, tp: int, dp: int) -> None:
    """DP=2 sums the KL over both ranks' shares (default run); TP=2 splits the reference's
    layers and vocabulary (-m slow: the shared 2-core machine)."""
    model = resolve_model_path("tiny-qwen2")
    ref = cases.perturbed_copy(model, str(tmp_path / "ref"))  # KL > 0 from the first step
    one = run_distributed(cases.one_step_against, 1, model, ref, 1, 1, timeout=600)[0]
    mask = one["loss_mask"].bool()
    assert one["stats"]["actor/kl_ref"] > 1e-3
    assert one["stats"]["train/kl"] == pytest.approx(one["stats"]["actor/kl_ref"], rel=1e-4)
    for rank in run_distributed(cases.one_step_against, 2, model, ref, tp, dp, timeout=600):
        assert torch.allclose(rank["ref_logprobs"][mask], one["ref_logprobs"][mask], atol=1e-5, rtol=0)
        for key in ("train/loss", "train/kl", "actor/kl_ref", "actor/kl_loss"):
            assert rank["stats"][key] == pytest.approx(one["stats"][key], rel=1e-4), key
        assert torch.allclose(rank["after"][mask], one["after"][mask], atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_offload_moves_the_reference_off_the_gpu_and_back() -> None:
    out = run_distributed(cases.offload_roundtrip, 1, resolve_model_path("tiny-qwen2"), backend="nccl",
                          timeout=600)[0]
    assert out["bytes_offloaded"] == 0 and out["cuda_freed"] >= out["bytes_resident"] > 0
    assert out["offloaded_refuses"] and out["restored_equal"]


def test_a_reference_of_another_architecture_is_refused() -> None:
    cfg = load_config(None, ["algo.kl_coef=0.1", "model.ref_path=tiny-llama"])
    with pytest.raises(ConfigError, match="model.ref_path: .* has family=.llama., the policy .qwen2.") as info:
        reference_model_dir(cfg, resolve_model_path("tiny-qwen2"))
    assert "\n" not in str(info.value)


def test_the_reference_defaults_to_the_starting_weights(tmp_path: Path) -> None:
    policy = resolve_model_path("tiny-qwen2")
    assert reference_model_dir(load_config(None, ["algo.kl_coef=0.1"]), policy) == policy
    with pytest.raises(ConfigError, match="no config.json"):
        reference_model_dir(load_config(None, ["algo.kl_coef=0.1", f"model.ref_path={tmp_path}"]), policy)

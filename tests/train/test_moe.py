"""Mixture-of-experts (Qwen3-MoE) in the training engine: HF conversion, log-probs against
HF, and expert parallelism (``ep2``, ``tp2 x ep2``, ``pp2 x ep2``) on gloo against one rank.

HF's Qwen3-MoE is transformers' own ``Qwen3MoeForCausalLM`` (the tiny model is built with
it and read back with ``from_pretrained``), so the routing compared against is the
reference implementation's, not ours."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import moe_cases as cases
from realscale.config import ConfigError, load_config
from realscale.models.family import arch_from_hf, load_arch
from realscale.models.megatron_gpt import moe_kwargs, transformer_config
from realscale.models.tiny import resolve_model_path
from realscale.parallel.spawn import DistributedError, run_distributed
from realscale.train.engine import split_to_count

STEPS = 2
LAYOUTS_4 = {"tp2-ep2": (2, 1, 2), "pp2-ep2": (1, 2, 2)}  # tp2 with sequence parallelism (moe_cases.engine)


@pytest.fixture(scope="module")
def model() -> str:
    return resolve_model_path("tiny-qwen3-moe")


def _jobs(model: str, tp: int, pp: int, ep: int, out: Path, tag: str, uneven: bool) -> list[tuple[str, tuple]]:
    jobs = [("logits_vs_hf", (model, tp, pp, ep)),
            ("train_steps", (model, tp, pp, ep, STEPS)),
            ("export_untrained", (model, tp, pp, ep, str(out / f"untrained-{tag}")))]
    jobs.append(("replay", (model, tp, pp, ep)))
    if uneven:  # 3 sequences: one data-parallel rank gets 2, the other 1 (a filler micro-batch)
        jobs.append(("train_steps", (model, tp, pp, ep, STEPS, 3, 16, 0.0, str(out / f"trained-{tag}"))))
    return jobs


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("moe")
    got: dict[str, Any] = {"out": out}
    got["one"] = run_distributed(cases.run_many, 1, _jobs(model, 1, 1, 1, out, "one", True), timeout=400)[0]
    got["ep2"] = run_distributed(cases.run_many, 2, _jobs(model, 1, 1, 2, out, "ep2", True), timeout=400)
    for name, (tp, pp, ep) in LAYOUTS_4.items():
        got[name] = run_distributed(cases.run_many, 4, _jobs(model, tp, pp, ep, out, name, False), timeout=600)
    return got


def _last_stage(per_rank: list[Any], i: int) -> Any:
    """Job ``i``'s result on a rank that holds the output layer (rank 0 unless pp > 1)."""
    return next(r[i] for r in per_rank if r[i].get("diff", 0.0) is not None)


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    for sa, sb in zip(a["stats"], b["stats"], strict=True):
        assert abs(sa["loss"] - sb["loss"]) <= 1e-5 * max(abs(sa["loss"]), 1e-3), (sa["loss"], sb["loss"])
        assert abs(sa["grad_norm"] - sb["grad_norm"]) <= 1e-5 * sa["grad_norm"], (sa["grad_norm"], sb["grad_norm"])
    assert (a["lp1"] - a["lp0"]).abs().max() > 1e-2  # the steps changed the policy
    assert torch.allclose(a["lp1"], b["lp1"], atol=1e-4, rtol=0)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ----------------------------------------------------------------------------- pure parts


def test_qwen3_moe_config_is_read_and_what_is_not_supported_is_refused(model: str) -> None:
    arch = load_arch(model)
    assert arch.family.name == "qwen3_moe" and arch.family.qk_norm
    assert arch.moe is not None
    assert (arch.moe.num_experts, arch.moe.topk, arch.moe.ffn_hidden_size) == (4, 2, 32)
    assert arch.moe.norm_topk_prob and arch.moe.aux_loss_coef == 0.001
    hf = json.loads((Path(model) / "config.json").read_text())
    assert "num_local_experts" in hf  # transformers 5 writes this name; older configs say num_experts
    old = {k: v for k, v in hf.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert arch_from_hf(old).moe.num_experts == 8
    for bad, why in (({"mlp_only_layers": [1]}, "dense layers"), ({"decoder_sparse_step": 2}, "dense layers"),
                     ({"shared_expert_intermediate_size": 64}, "shared experts"),
                     ({"num_experts_per_tok": 5}, "num_experts_per_tok=5")):
        with pytest.raises(ValueError, match=why):
            arch_from_hf(hf | bad)


def test_megatron_routing_follows_norm_topk_prob_and_the_aux_knob(model: str) -> None:
    arch = load_arch(model)
    kw = moe_kwargs(arch, ep=2, aux_loss_coef=None)
    assert kw["moe_router_pre_softmax"] is False  # softmax over the top-k logits == renormalised top-k
    assert kw["moe_aux_loss_coeff"] == 0.001 and kw["moe_router_load_balancing_type"] == "aux_loss"
    assert kw["expert_model_parallel_size"] == 2 and kw["moe_token_dispatcher_type"] == "alltoall"
    off = moe_kwargs(arch, ep=1, aux_loss_coef=0.0)
    assert off["moe_router_load_balancing_type"] == "none"
    hf = json.loads((Path(model) / "config.json").read_text())
    assert moe_kwargs(arch_from_hf(hf | {"norm_topk_prob": False}), 1, None)["moe_router_pre_softmax"] is True
    with pytest.raises(ValueError, match="ep=3 must divide the 4 experts"):
        moe_kwargs(arch, ep=3, aux_loss_coef=None)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        moe_kwargs(load_arch(resolve_model_path("tiny-qwen3")), ep=2, aux_loss_coef=None)
    with pytest.raises(ValueError, match="tp=2 needs sequence parallelism"):
        transformer_config(arch, tp=2, ep=2)


def test_config_refuses_an_ep_that_does_not_divide_dp() -> None:
    with pytest.raises(ConfigError, match="parallel.ep=2 must divide parallel.dp=3"):
        load_config(None, ["parallel.dp=3", "parallel.ep=2"])
    with pytest.raises(ConfigError, match="moe_aux_loss_coef"):
        load_config(None, ["train.moe_aux_loss_coef=-0.5"])


def test_split_to_count_halves_the_largest_micro_batch_by_tokens() -> None:
    lens = [10, 2, 2, 6, 4]
    assert split_to_count([[0, 1, 2], [3, 4]], lens, 3) == [[0], [1, 2], [3, 4]]
    assert split_to_count([[0, 1, 2], [3, 4]], lens, 4) == [[0], [1, 2], [3], [4]]
    assert split_to_count([[0], [1]], lens, 4) == [[0], [1]]  # nothing left to split: fillers make up the rest
    assert split_to_count([[0, 1]], lens, 1) == [[0, 1]]


# ----------------------------------------------------------------------------- on gloo


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["one", "ep2", *LAYOUTS_4])
def test_logits_match_hf(runs: dict[str, Any], layout: str) -> None:
    got = runs[layout][0] if layout == "one" else _last_stage(runs[layout], 0)
    assert got["diff"] < 1e-5 * got["scale"] + 1e-6, got


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["ep2", *LAYOUTS_4])
def test_training_on_n_ranks_matches_one(runs: dict[str, Any], layout: str) -> None:
    one = runs["one"][1]
    assert one["stats"][0]["micro_batches"] > 1
    for rank_result in runs[layout]:
        _same_run(one, rank_result[1])


@pytest.mark.multiproc
def test_a_rank_with_fewer_sequences_runs_fillers_and_still_matches_one(runs: dict[str, Any]) -> None:
    per_rank = [r[4] for r in runs["ep2"]]
    assert per_rank[0]["micro_batches"] == (2, 2)
    assert per_rank[1]["micro_batches"] == (1, 2)  # one sequence: one micro-batch and one filler
    _same_run(runs["one"][4], per_rank[0])


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["one", "ep2", *LAYOUTS_4])
def test_export_gathers_every_expert_bit_for_bit(runs: dict[str, Any], model: str, layout: str) -> None:
    source = _tensors(Path(model))
    exported = _tensors(runs["out"] / f"untrained-{layout}")
    assert sorted(exported) == sorted(source)
    assert sum("mlp.experts." in n for n in exported) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    for name, t in source.items():
        assert torch.equal(exported[name], t), name


@pytest.mark.multiproc
def test_trained_export_on_two_ranks_matches_one(runs: dict[str, Any], model: str) -> None:
    one, two = _tensors(runs["out"] / "trained-one"), _tensors(runs["out"] / "trained-ep2")
    source = _tensors(Path(model))
    moved = [n for n in one if "experts" in n and not torch.equal(one[n], source[n])]
    assert moved, "no expert weight changed in training"
    for name, t in one.items():
        assert torch.allclose(two[name], t, atol=1e-5, rtol=0), name


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["one", "ep2", *LAYOUTS_4])
def test_routing_replay_forces_the_given_experts_in_every_layout(runs: dict[str, Any], layout: str) -> None:
    """Replaying the model's own routing changes nothing; replaying other experts changes
    the log-probs, the same way on one rank and under ep2, tp2 x ep2 (sequence-parallel
    slices) and pp2 x ep2 (each stage its own layers); a PPO step under the replayed
    routing trains the router and experts it was given."""
    one = runs["one"][3]
    got = one if layout == "one" else runs[layout][0][3]  # rank 0 (logprobs reach every pipeline stage)
    assert torch.allclose(one["own"], one["plain"], atol=1e-5, rtol=0)
    # other experts, other log-probs (a random tiny model: near-uniform output, so differences are small)
    assert (one["forced"] - one["plain"]).abs().max() > 0.02
    for key in ("plain", "own", "forced", "after", "after_plain"):
        assert torch.allclose(got[key], one[key], atol=1e-4, rtol=0), (layout, key)
    assert (one["after"] - one["forced"]).abs().max() > 1e-3  # the step moved the replayed path
    assert abs(got["stats"]["grad_norm"] - one["stats"]["grad_norm"]) <= 1e-4 * one["stats"]["grad_norm"]


@pytest.mark.multiproc
@pytest.mark.e2e  # heavy (~23 s, three spawned runs): CI's e2e tier, keeping the default tier under 15 minutes
def test_a_checkpoint_of_an_ep2_run_resumes_exactly_and_refuses_ep1(model: str, tmp_path: Path) -> None:
    """Megatron's distributed checkpoint of expert-parallel weights and Adam state: saved
    by ep2 ranks, loaded by ep2 ranks again, continuing exactly as the run that saved it.
    One rank (ep=1, a single optimizer where ep2 chains two) is refused in one line."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(cases.run_many, 2, [("checkpoint", (model, 1, 1, 2, ckpt, "save"))], timeout=400)[0][0]
    two = run_distributed(cases.run_many, 2, [("checkpoint", (model, 1, 1, 2, ckpt, "load"))], timeout=400)[0][0]
    for a, b in zip(two["losses"] + two["grad_norms"], saved["losses"] + saved["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-5 * max(abs(b), 1e-3), (two, saved)
    with pytest.raises(DistributedError, match="written with parallel.ep=2; this run has parallel.ep=1"):
        run_distributed(cases.run_many, 1, [("checkpoint", (model, 1, 1, 1, ckpt, "load"))], timeout=400)


@pytest.mark.multiproc
def test_the_load_balancing_loss_knob_moves_the_router(model: str) -> None:
    off, on = run_distributed(cases.run_many, 1, [("router_after_step", (model, 0.0)),
                                                  ("router_after_step", (model, 1.0))], timeout=300)[0]
    assert (off["aux_type"], off["aux_coef"]) == ("none", 0.0)
    assert (on["aux_type"], on["aux_coef"]) == ("aux_loss", 1.0)
    assert (on["router"] - off["router"]).abs().max() > 1e-6

"""Chunked vocab-parallel log-probs and entropy vs the straightforward full-vocab reference.

Single process: values and gradients of both entry points (from logits, from hidden
states) against autograd through ``reference_logprobs`` (which is the generation server's
``token_logprobs`` on the full, unpadded logits), across temperatures, padded vocabularies
and chunk sizes that do not divide T. TP=2: two gloo ranks over megatron's TP group
against the single-process reference, and against megatron's own vocab-parallel
cross-entropy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import logprob_cases
from realscale.parallel.spawn import run_distributed
from realscale.train.logprobs import (logprobs_from_hidden, next_token_targets, reference_logprobs,
                                      vocab_parallel_logprobs)

ATOL = 1e-5


def make_case(n: int, vocab: int, padded: int, hidden: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hidden states, an output weight (padded rows included, and large so a padding bug
    would move the softmax), targets and upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(padded, hidden, generator=g) * 0.5
    weight[vocab:] += 3.0  # padded rows: large logits that must not enter the softmax
    h = torch.randn(n, hidden, generator=g) * 0.5
    return {"hidden": h, "weight": weight, "logits": h @ weight.t(),
            "targets": torch.randint(0, vocab, (n,), generator=g),
            "g_lp": torch.randn(n, generator=g), "g_h": torch.randn(n, generator=g)}


def reference(case: dict[str, Any], temperature: float, vocab: int, entropy: bool) -> dict[str, torch.Tensor | None]:
    """Reference values and gradients (w.r.t. logits, hidden and weight) by plain autograd."""
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    logits = h @ w.t()
    logits.retain_grad()
    lp, ent = reference_logprobs(logits, case["targets"], temperature=temperature, true_vocab_size=vocab,
                                 with_entropy=entropy)
    loss = (lp * case["g_lp"]).sum() + ((ent * case["g_h"]).sum() if ent is not None else 0.0)
    loss.backward()
    return {"lp": lp.detach(), "ent": None if ent is None else ent.detach(), "grad_logits": logits.grad,
            "grad_hidden": h.grad, "grad_weight": w.grad}


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- single process


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("vocab,padded", [(50, 56), (56, 56)])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("entropy", [False, True])
def test_from_logits_matches_reference(temperature: float, vocab: int, padded: int, chunk: int, entropy: bool) -> None:
    case = make_case(23, vocab, padded)
    ref = reference(case, temperature, vocab, entropy)
    logits = case["logits"].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(logits, case["targets"], temperature=temperature, vocab_start=0,
                                      true_vocab_size=vocab, chunk_tokens=chunk, with_entropy=entropy)
    assert lp.dtype == torch.float32 and lp.shape == (23,)
    close(lp, ref["lp"], "logprobs")
    if entropy:
        close(ent, ref["ent"], "entropy")
        assert bool((ent >= 0).all()) and bool((ent <= math.log(vocab) + 1e-5).all())
    else:
        assert ent is None
    ((lp * case["g_lp"]).sum() + ((ent * case["g_h"]).sum() if entropy else 0.0)).backward()
    close(logits.grad, ref["grad_logits"], "grad logits")
    assert bool((logits.grad[:, vocab:] == 0).all()), "padded vocab columns got a gradient"


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("vocab,padded", [(50, 56), (56, 56)])
@pytest.mark.parametrize("chunk", [3, 10, 64])
@pytest.mark.parametrize("entropy", [False, True])
def test_from_hidden_matches_reference(temperature: float, vocab: int, padded: int, chunk: int, entropy: bool) -> None:
    case = make_case(29, vocab, padded)
    ref = reference(case, temperature, vocab, entropy)
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    lp, ent = logprobs_from_hidden(h, w, case["targets"], temperature=temperature, vocab_start=0,
                                   true_vocab_size=vocab, chunk_tokens=chunk, with_entropy=entropy)
    close(lp, ref["lp"], "logprobs")
    if entropy:
        close(ent, ref["ent"], "entropy")
    ((lp * case["g_lp"]).sum() + ((ent * case["g_h"]).sum() if entropy else 0.0)).backward()
    close(h.grad, ref["grad_hidden"], "grad hidden")
    close(w.grad, ref["grad_weight"], "grad weight")
    assert bool((w.grad[vocab:] == 0).all()), "padded vocab rows got a gradient"


@pytest.mark.parametrize("fn", ["logits", "hidden"])
def test_entropy_only_and_logprob_only_gradients(fn: str) -> None:
    """The backward handles an unused output (its gradient arrives as None)."""
    case = make_case(11, 40, 48)
    for use in ("lp", "ent"):
        ref = reference({**case, "g_lp": case["g_lp"] * (use == "lp"), "g_h": case["g_h"] * (use == "ent")},
                        0.9, 40, True)
        x = (case["logits"] if fn == "logits" else case["hidden"]).clone().requires_grad_()
        kw = dict(temperature=0.9, vocab_start=0, true_vocab_size=40, chunk_tokens=4, with_entropy=True)
        lp, ent = (vocab_parallel_logprobs(x, case["targets"], **kw) if fn == "logits"
                   else logprobs_from_hidden(x, case["weight"], case["targets"], **kw))
        ((lp * case["g_lp"]).sum() if use == "lp" else (ent * case["g_h"]).sum()).backward()
        close(x.grad, ref["grad_logits" if fn == "logits" else "grad_hidden"], f"{fn} grad, {use} only")


def test_bf16_inputs_give_fp32_logprobs_of_the_upcast_logits() -> None:
    case = make_case(17, 50, 56)
    h, w = case["hidden"].bfloat16(), case["weight"].bfloat16()
    logits = (h @ w.t()).requires_grad_()
    lp, _ = vocab_parallel_logprobs(logits, case["targets"], temperature=0.8, vocab_start=0, true_vocab_size=50,
                                    chunk_tokens=5)
    ref, _ = reference_logprobs(logits.detach().float(), case["targets"], temperature=0.8, true_vocab_size=50)
    assert lp.dtype == torch.float32
    close(lp, ref, "bf16 logits")
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    hw = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp_h, _ = logprobs_from_hidden(*hw, case["targets"], temperature=0.8, vocab_start=0, true_vocab_size=50,
                                   chunk_tokens=5)
    close(lp_h, ref, "bf16 hidden")  # same bf16 matmul per row, so the same logits
    lp_h.sum().backward()
    assert hw[0].grad.dtype == torch.bfloat16 and hw[1].grad.dtype == torch.bfloat16


@pytest.mark.parametrize("fn", ["logits", "hidden"])
def test_nothing_of_size_tokens_times_vocab_is_saved_for_backward(fn: str) -> None:
    """Backward recomputes each chunk: autograd keeps only the inputs and [T] statistics."""
    n, vocab = 64, 200
    case = make_case(n, vocab, vocab)
    saved: list[torch.Tensor] = []
    x = (case["logits"] if fn == "logits" else case["hidden"]).clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        kw = dict(temperature=1.3, vocab_start=0, true_vocab_size=vocab, chunk_tokens=8, with_entropy=True)
        lp, ent = (vocab_parallel_logprobs(x, case["targets"], **kw) if fn == "logits"
                   else logprobs_from_hidden(x, w, case["targets"], **kw))
    inputs = {x.data_ptr(), w.data_ptr()}
    extra = [tuple(t.shape) for t in saved if t.data_ptr() not in inputs]
    assert extra and all(len(s) == 1 and s[0] <= n for s in extra), extra
    (lp.sum() + ent.sum()).backward()


@pytest.mark.parametrize("entropy", [False, True])
def test_empty_input(entropy: bool) -> None:
    logits = torch.zeros(0, 8, requires_grad=True)
    lp, ent = vocab_parallel_logprobs(logits, torch.zeros(0, dtype=torch.long), vocab_start=0, true_vocab_size=8,
                                      with_entropy=entropy)
    assert lp.shape == (0,) and (ent is None or ent.shape == (0,))
    lp.sum().backward()
    assert logits.grad.shape == (0, 8)
    h, w = torch.zeros(0, 4, requires_grad=True), torch.randn(8, 4, requires_grad=True)
    lp, _ = logprobs_from_hidden(h, w, torch.zeros(0, dtype=torch.long), vocab_start=0, true_vocab_size=8)
    lp.sum().backward()
    assert h.grad.shape == (0, 4) and bool((w.grad == 0).all())


def test_single_token_vocab_and_one_hot_logits() -> None:
    """Degenerate distributions: a one-token vocabulary (log-prob 0, entropy 0) and a
    saturated softmax (huge logit gaps stay finite)."""
    lp, ent = vocab_parallel_logprobs(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), vocab_start=0,
                                      true_vocab_size=1, with_entropy=True)
    assert bool((lp == 0).all()) and bool((ent.abs() < 1e-6).all())
    logits = torch.tensor([[1e4, 0.0, -1e4], [0.0, 1e4, 0.0]], requires_grad=True)
    lp, ent = vocab_parallel_logprobs(logits, torch.tensor([0, 0]), vocab_start=0, true_vocab_size=3,
                                      with_entropy=True)
    ref, ref_ent = reference_logprobs(logits.detach(), torch.tensor([0, 0]), true_vocab_size=3, with_entropy=True)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    close(lp, ref, "saturated")
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all()


def test_bad_arguments_name_the_culprit() -> None:
    logits, tg = torch.randn(5, 10), torch.randint(0, 8, (5,))
    kw: dict[str, Any] = dict(vocab_start=0, true_vocab_size=8)
    cases = [
        (dict(targets=torch.tensor([0, 1, 8, 2, 3])), ValueError, "token id 8 is outside the vocabulary"),
        (dict(targets=torch.tensor([0, -1, 2, 2, 3])), ValueError, "token id -1"),
        (dict(targets=tg[:4]), ValueError, "targets: expected shape \\(5,\\)"),
        (dict(targets=tg.float()), TypeError, "targets: expected an integer"),
        (dict(logits_shard=torch.randn(5)), ValueError, "logits_shard"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(chunk_tokens=0), ValueError, "chunk_tokens"),
        (dict(vocab_start=10), ValueError, "vocab_start: .* must be 0"),
        (dict(true_vocab_size=11), ValueError, "true_vocab_size: 11 exceeds the padded vocabulary"),
        (dict(true_vocab_size=0), ValueError, "true_vocab_size"),
    ]
    for override, exc, pattern in cases:
        args = {"logits_shard": logits, "targets": tg, **kw, **override}
        with pytest.raises(exc, match=pattern):
            vocab_parallel_logprobs(args.pop("logits_shard"), args.pop("targets"), **args)
    with pytest.raises(ValueError, match="disagree on H"):
        logprobs_from_hidden(torch.randn(5, 4), torch.randn(10, 3), tg, **kw)
    with pytest.raises(TypeError, match="share a dtype"):
        logprobs_from_hidden(torch.randn(5, 4), torch.randn(10, 4).double(), tg, **kw)


def test_next_token_targets_on_packed_sequences() -> None:
    tokens = torch.tensor([5, 6, 7, 1, 2, 9])
    targets, valid = next_token_targets(tokens, torch.tensor([0, 3, 3, 5, 6]))  # includes an empty sequence
    assert targets.tolist() == [6, 7, 7, 2, 2, 9]
    assert valid.tolist() == [True, True, False, True, False, False]
    with pytest.raises(ValueError, match="cu_seqlens"):
        next_token_targets(tokens, torch.tensor([0, 3, 5]))


# --------------------------------------------------------------------------- TP = 2


TP_CASES = [  # (kind, tokens, vocab, padded, temperature, chunk, entropy)
    ("logits", 21, 50, 56, 0.7, 4, True),     # rank 1's shard is partly padding
    ("logits", 13, 56, 56, 1.0, 5, False),
    ("logits", 9, 20, 48, 1.3, 4, True),      # rank 1's shard is all padding
    ("hidden", 19, 50, 56, 0.8, 6, True),
    ("hidden", 10, 56, 56, 1.0, 3, False),
    ("megatron_ce", 15, 56, 56, 1.0, 0, False),
]


@pytest.fixture(scope="module")
def tp2() -> list[tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]]:
    cases, refs = [], []
    for i, (kind, n, vocab, padded, temp, chunk, ent) in enumerate(TP_CASES):
        c = make_case(n, vocab, padded, seed=i)
        cases.append({**c, "kind": kind, "V": vocab, "T": temp, "chunk": chunk, "entropy": ent})
        refs.append(reference(c, temp, vocab, ent))
    per_rank = run_distributed(logprob_cases.run_cases, 2, cases, timeout=300)
    return [(cases[k], refs[k], [per_rank[r][k] for r in range(2)]) for k in range(len(cases))]


@pytest.mark.multiproc
@pytest.mark.parametrize("k", range(len(TP_CASES)), ids=[f"{c[0]}-{i}" for i, c in enumerate(TP_CASES)])
def test_tp2_matches_single_process(tp2: list, k: int) -> None:
    case, ref, ranks = tp2[k]
    padded = case["weight"].shape[0]
    for rank, out in enumerate(ranks):
        close(out["lp"], ref["lp"], f"rank {rank} logprobs")
        if case["entropy"]:
            close(out["ent"], ref["ent"], f"rank {rank} entropy")
        cols = slice(rank * padded // 2, (rank + 1) * padded // 2)
        if case["kind"] == "hidden":
            close(out["grad"], ref["grad_weight"][cols], f"rank {rank} weight-shard grad")
            close(out["grad_hidden"], ref["grad_hidden"], f"rank {rank} hidden grad (after TP all-reduce)")
        else:
            close(out["grad"], ref["grad_logits"][:, cols], f"rank {rank} logits-shard grad")

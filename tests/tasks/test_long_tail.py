"""The long_tail task: long-tailed lengths, checkable answers, disjoint reproducible splits,
the hook that selects it from ``data.source``, and its token layout."""

from __future__ import annotations

import numpy as np
import pytest

from realscale.config import load_config
from realscale.tasks.arith import encode_example, is_correct, prompt_ids, resolve_task_source, task_from_config
from realscale.tasks.long_tail import CountdownProblem, LongTailTask


def test_worked_example() -> None:
    p = CountdownProblem(7, 4)
    assert p.prompt == "7 4"
    assert p.worked() == "04:0 03:3 02:6 01:9"
    assert p.answer == "9"
    assert is_correct(p.worked(), p.answer)  # the RL reward and the evaluator read the scratchpad's last number


def test_answers_match_the_scratchpad() -> None:
    for p in LongTailTask(min_steps=1, max_steps=30).all_problems():
        items = p.worked().split(" ")
        assert [int(it.split(":")[0]) for it in items] == list(range(p.steps, 0, -1))
        running = [int(it.split(":")[1]) for it in items]
        assert running == [(p.start + 3 * (p.steps - c + 1)) % 10 for c in range(p.steps, 0, -1)]
        assert p.answer == str(running[-1])
        assert is_correct(p.worked(), p.answer)
        wrong = str((int(p.answer) + 1) % 10)
        assert not is_correct(p.worked()[:-1] + wrong, p.answer)


def test_response_lengths_are_long_tailed() -> None:
    task = LongTailTask(train_size=4000, heldout_size=400, seed=0)
    lengths = np.array([len(p.worked()) + 1 for p in task.split("train")])  # one token per character, + EOS
    median, mean, p99, top = np.median(lengths), lengths.mean(), np.percentile(lengths, 99), lengths.max()
    # heavy right tail: the mean sits well above the median and the longest are >10x the median
    assert mean > 1.6 * median
    assert p99 > 8 * median and top >= 10 * median
    assert top == 5 * task.max_steps
    # the step counts follow the power law P(n) ∝ n^-alpha, in both splits
    probs = task.step_probs()
    for name in ("train", "heldout"):
        ns = np.array([p.steps for p in task.split(name)])
        for n in (2, 3, 5, 10):
            assert abs((ns == n).mean() - probs[n - task.min_steps]) < 0.04, (name, n)


def test_splits_disjoint_reproducible_and_seeded() -> None:
    task = LongTailTask(train_size=2000, heldout_size=300, seed=5)
    train, held = task.split("train"), task.split("heldout")
    assert len(train) == 2000 and len(held) == 300
    assert not set(train) & set(held)
    assert all(task.is_heldout(p) for p in held) and not any(task.is_heldout(p) for p in train)
    # exactly one start digit in ten is held out for each step count
    for n in range(task.min_steps, task.max_steps + 1):
        assert sum(task.is_heldout(CountdownProblem(x, n)) for x in range(10)) == 1
    again = LongTailTask(train_size=2000, heldout_size=300, seed=5)
    assert again.split("train") == train and again.split("heldout") == held
    assert LongTailTask(train_size=2000, heldout_size=300, seed=6).split("heldout") != held


def test_bad_knobs_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="max_steps"):
        LongTailTask(max_steps=100)
    with pytest.raises(ValueError, match="min_steps"):
        LongTailTask(min_steps=5, max_steps=4)
    with pytest.raises(ValueError, match="alpha"):
        LongTailTask(alpha=0.0)
    with pytest.raises(ValueError, match="heldout_size"):
        LongTailTask(heldout_size=0)
    with pytest.raises(ValueError, match="split"):
        LongTailTask().split("test")


def test_length_strata_cover_every_length_in_proportion() -> None:
    task = LongTailTask(min_steps=2, max_steps=90)
    strata = task.length_strata(1200)
    assert [n for n, _, _ in strata] == list(range(2, 91))
    assert sum(p for _, p, _ in strata) == pytest.approx(1.0)
    for n, p, problems in strata:
        assert len(problems) == max(1, round(1200 * p))
        assert {q.steps for q in problems} == {n}
        counts = np.bincount([q.start for q in problems], minlength=10)
        assert counts.max() - counts.min() <= 1  # start digits in turn: none weighs more than its share
    # a short stratum holds all ten problems, train and held-out alike, so no single problem is
    # P(2) of the estimate as the held-out split's one problem per length is
    assert len({q.start for q in strata[0][2]}) == 10
    assert any(task.is_heldout(q) for q in strata[0][2]) and not all(task.is_heldout(q) for q in strata[0][2])
    # the weighted share right is exact on a known answer pattern: right iff the start is even
    right = sum(p * np.mean([q.start % 2 == 0 for q in problems]) for _, p, problems in strata)
    assert 0.45 < right < 0.55
    with pytest.raises(ValueError, match="budget"):
        task.length_strata(0)


def test_data_source_selects_the_task_and_its_knobs(tmp_path) -> None:
    from realscale.data.dataset import PromptDataset

    cfg = load_config(None, ["data.source=task:long_tail", "data.size=64", "data.task_heldout=16",
                             "data.task_max_steps=12", "data.task_tail_alpha=1.2", "data.task_seed=3"])
    task = task_from_config(cfg.data)
    assert task == LongTailTask(min_steps=2, max_steps=12, alpha=1.2, train_size=64, heldout_size=16, seed=3)
    path = resolve_task_source(cfg.data.source, task, str(tmp_path), "train")
    assert path.endswith("long_tail-train.jsonl")
    ds = PromptDataset(path, shuffle=False)
    assert [(s.prompt, s.answer) for s in ds.samples] == [(p.prompt, p.answer) for p in task.split("train")]
    assert ds.samples[0].metadata["task"] == "long_tail"
    # the arithmetic task is still what task:arith means
    assert type(task_from_config(load_config(None, ["data.source=task:arith"]).data)).__name__ == "ArithTask"


def test_token_layout_masks_exactly_the_scratchpad_and_eos(tiny_tokenizer) -> None:
    p = CountdownProblem(3, 12)
    ids, mask = encode_example(tiny_tokenizer, p, worked=True)
    head = prompt_ids(tiny_tokenizer, p.prompt)
    assert ids[: len(head)] == head and not any(mask[: len(head)])
    taught = [i for i, m in zip(ids, mask) if m]
    assert taught[-1] == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(taught, skip_special_tokens=True) == p.worked()
    assert len(taught) == len(p.worked()) + 1 == 5 * p.steps  # one token per character: the module's length law
    direct, _ = encode_example(tiny_tokenizer, p)  # the direct style: the bare answer
    assert tiny_tokenizer.decode(direct[len(head):], skip_special_tokens=True) == p.answer


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from realscale.models.tiny import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))

"""The arith task: deterministic disjoint splits, correct answers, token layout, JSONL export."""

from __future__ import annotations

import operator

import pytest

from realscale.tasks.arith import ArithTask, Problem, encode_example, is_correct, prompt_ids, resolve_task_source


def _value(p: Problem) -> int:
    a, b = p.prompt[:-1].split(p.op)
    return {"+": operator.add, "-": operator.sub}[p.op](int(a), int(b))


def test_splits_deterministic_disjoint_and_complete() -> None:
    task = ArithTask(max_operand=30, ops="+-", heldout_size=100, seed=3)
    train, held = task.split("train"), task.split("heldout")
    assert train == ArithTask(max_operand=30, ops="+-", heldout_size=100, seed=3).split("train")
    assert len(held) == 100 and not set(train) & set(held)
    assert set(train) | set(held) == set(task.all_problems())
    assert len(task.all_problems()) == 31 * 31 + 31 * 32 // 2  # all sums, differences with a >= b
    assert ArithTask(max_operand=30, ops="+-", heldout_size=100, seed=4).split("heldout") != held


def test_answers_are_correct_and_non_negative() -> None:
    for p in ArithTask(max_operand=25, ops="+-", heldout_size=10).all_problems():
        assert p.answer == str(_value(p)) and int(p.answer) >= 0


def test_bad_knobs_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="ops"):
        ArithTask(ops="*")
    with pytest.raises(ValueError, match="heldout_size"):
        ArithTask(max_operand=3, heldout_size=16)
    with pytest.raises(ValueError, match="split"):
        ArithTask().split("test")


def test_token_layout_masks_exactly_answer_and_eos(tiny_tokenizer) -> None:
    p = Problem(47, "+", 38)
    ids, mask = encode_example(tiny_tokenizer, p)
    head = prompt_ids(tiny_tokenizer, p.prompt)
    assert ids[: len(head)] == head and len(head) <= 32
    answer_ids = [i for i, m in zip(ids, mask) if m]
    assert answer_ids[-1] == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(answer_ids, skip_special_tokens=True) == "85"
    # the prompt is what the RL workflow sends: chat template ending in the assistant turn
    assert tiny_tokenizer.decode(head).endswith("47+38=<|im_end|>\n<|im_start|>assistant\n")


def test_is_correct_matches_final_number() -> None:
    assert is_correct("85", "85")
    assert is_correct("I think 80, no: 85", "85")
    assert not is_correct("58", "85")
    assert not is_correct("", "85")
    assert not is_correct("eighty-five", "85")


def test_task_source_is_readable_by_prompt_dataset(tmp_path) -> None:
    from realscale.data.dataset import PromptDataset

    task = ArithTask(max_operand=9, heldout_size=20)
    path = resolve_task_source("task:arith", task, str(tmp_path), "train")
    ds = PromptDataset(path, shuffle=False)
    assert [(s.prompt, s.answer) for s in ds.samples] == [(p.prompt, p.answer) for p in task.split("train")]
    assert resolve_task_source("data.jsonl", task, str(tmp_path)) == "data.jsonl"
    with pytest.raises(ValueError, match="unknown task"):
        resolve_task_source("task:nope", task, str(tmp_path))


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from realscale.models.tiny import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))

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


def _column_sums(worked: str) -> int:
    """Re-add a worked answer's columns: every column's digits plus carry, as written."""
    cols, total = worked[1:worked.index(")")].split(","), 0
    for i, col in enumerate(cols):
        lhs, rhs = col.split("=")
        assert sum(int(x) for x in lhs.split("+")) == int(rhs)  # each column adds up
        total += (int(rhs) % 10) * 10 ** i
    return total + (int(cols[-1].split("=")[1]) // 10) * 10 ** len(cols)


def test_worked_answers_add_up_and_end_in_the_answer() -> None:
    assert Problem(47, "+", 38).worked() == "(7+8=15,4+3+1=8)85"
    assert Problem(9, "-", 3).worked() == "6"  # subtractions are answered directly
    for p in ArithTask(max_operand=120, ops="+", heldout_size=10).all_problems()[::37]:
        w = p.worked()
        assert w.endswith(")" + p.answer) and _column_sums(w) == int(p.answer), w
        assert is_correct(w, p.answer) and not is_correct(w[:-1] + str((int(w[-1]) + 1) % 10), p.answer)


def test_sft_batches_mix_the_two_styles_by_fraction() -> None:
    from realscale.models.tiny import build_tiny_model
    from realscale.sft import batches
    from transformers import AutoTokenizer
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tok = AutoTokenizer.from_pretrained(build_tiny_model(d))
    problems = ArithTask(max_operand=29, heldout_size=10).split("train")
    open_paren = tok("(", add_special_tokens=False)["input_ids"][0]

    def worked_share(fraction: float) -> float:
        firsts = []
        for b in batches(tok, problems, batch_size=64, steps=8, seed=0, worked_fraction=fraction):
            cu = b.cu_seqlens.tolist()
            mask = b.fields["loss_mask"]
            for s, e in zip(cu[:-1], cu[1:]):
                first = s + int(mask[s:e].nonzero()[0])  # the first answer token
                firsts.append(int(b.input_ids[first]) == open_paren)
        return sum(firsts) / len(firsts)

    assert worked_share(0.0) == 0.0 and worked_share(1.0) == 1.0
    assert 0.4 < worked_share(0.5) < 0.6


def test_tool_demonstration_is_laid_out_as_the_multi_turn_workflow_lays_out_an_episode() -> None:
    """SFT's calculator demonstrations are token for token what MultiTurnWorkflow builds when
    the model says the same things, with the loss mask on the model's own tokens only. The
    'model' here is a script that replays the demonstration's turns (the layout is the
    subject, not sampling)."""
    import asyncio
    import tempfile

    from transformers import AutoTokenizer

    from realscale.data.dataset import PromptSample
    from realscale.inference.client import GenerateResult
    from realscale.models.tiny import build_tiny_model
    from realscale.rollout.workflows import CalculatorEnv, MultiTurnWorkflow
    from realscale.tasks.arith import encode_tool_example

    with tempfile.TemporaryDirectory() as d:
        tok = AutoTokenizer.from_pretrained(build_tiny_model(d))
    problem = ArithTask(max_operand=99, heldout_size=10).split("train")[0]
    eos = tok.eos_token_id

    class Script:
        def __init__(self, turns: list[str]) -> None:
            self.turns = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in turns]

        async def generate(self, ids: list[int], params: dict) -> GenerateResult:
            out = self.turns.pop(0)
            return GenerateResult(ids, out, [-0.1] * len(out), [0] * len(out), {"type": "stop"})

    for use_tool, turns in ((True, [f"<calc>{problem.prompt[:-1]}</calc>", f"<answer>{problem.answer}</answer>"]),
                            (False, [f"<answer>{problem.answer}</answer>"])):
        wf = MultiTurnWorkflow(tok, 1, {"max_new_tokens": 24}, CalculatorEnv, max_turns=3)
        sample = PromptSample(problem.prompt, problem.answer, uid="u")
        traj = asyncio.run(wf.run_episode(Script(turns), sample))[0]
        ids, mask = encode_tool_example(tok, problem, use_tool)
        assert traj.reward == 1.0 and traj.num_turns == len(turns)
        assert traj.prompt_ids + traj.output_ids == ids
        assert [0.0] * len(traj.prompt_ids) + [float(m) for m in traj.loss_mask] == mask
        assert ("<result>" in traj.completion_text) == use_tool

"""Dataset conversion: each layout's good and malformed rows, counts by reason, detection,
AReaL's prompts + id2info.json, held-out split, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from realscale.data.convert import (ConvertError, convert_file, convert_rows, detect_format, parse_gym_options,
                                    split_heldout, unwrap_chat_markup)
from realscale.data.dataset import PromptDataset


def _rows(*rows: object) -> list[tuple[int, object, str]]:
    return [(i, r, "") for i, r in enumerate(rows, start=1)]


def test_gsm8k_good_and_malformed_rows() -> None:
    good = {"question": "Tom has 3 apples and buys 1,200 more. How many?",
            "answer": "He has 3 + 1200 = <<3+1200=1203>>1203.\n#### 1,203"}
    rows = _rows(good, {"question": "q", "answer": "no marker"}, {"answer": "#### 4"},
                 {"question": "q2", "answer": "x\n#### four"}, dict(good), "not an object")
    out, rep = convert_rows(iter(rows), "gsm8k")
    assert [r["answer"] for r in out] == ["1203"]
    assert out[0]["metadata"]["solution"].endswith("#### 1,203")
    assert rep.rows == 6 and rep.kept == 1
    assert rep.refused == {"no '#### <answer>' line in 'answer'": 1, "'question' missing or empty": 1,
                           "the '####' answer is not a number": 1, "duplicate prompt": 1,
                           "expected an object, got str": 1}
    sft, _ = convert_rows(iter(_rows(good)), "gsm8k", target="sft")
    assert sft[0]["response"] == "He has 3 + 1200 = 1203.\nThe answer is \\boxed{1203}."  # calculator note gone


def test_math_deepscaler_aime_rows() -> None:
    math_rows = _rows({"problem": "p1", "solution": "So $x=\\boxed{\\frac{1}{2}}$."},
                      {"problem": "p2", "solution": "no box here"},
                      {"problem": "p3", "solution": "\\boxed{1}", "answer": "2"},  # the answer field wins
                      {"solution": "\\boxed{3}"})
    out, rep = convert_rows(iter(math_rows), "math")
    assert [(r["prompt"], r["answer"]) for r in out] == [("p1", "\\frac{1}{2}"), ("p3", "2")]
    assert rep.refused == {"no 'answer' field and no \\boxed{} answer in 'solution'": 1,
                           "no 'problem' (or 'Problem' / 'question') text": 1}
    aime = _rows({"Problem": "a1", "Answer": 204}, {"Problem": "a2", "Answer": "3/4"}, {"Problem": "a3", "Answer": None})
    out, rep = convert_rows(iter(aime), "aime")
    assert [r["answer"] for r in out] == ["204"] and rep.refused["AIME answers are integers"] == 1
    deep = _rows({"problem": "d1", "answer": "7", "solution": "..."}, {"problem": "d2", "answer": ""})
    out, rep = convert_rows(iter(deep), "deepscaler", target="sft")
    assert out == [{"prompt": "d1", "response": "..."}] and sum(rep.refused.values()) == 1


def test_areal_prompts_with_id2info(tmp_path: Path) -> None:
    """AReaL's early release: prompts (prompt + query_id) and id2info.json of solutions."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n", "query_id": "a"},
        {"prompt": "Solve x+1=3.", "query_id": "b@idx:7-0"},
        {"prompt": "Missing info", "query_id": "zzz"},
        {"prompt": "No boxed", "query_id": "c"},
        {"query_id": "d"},
    ]) + "\n{broken\n")
    id2info = tmp_path / "id2info.json"
    id2info.write_text(json.dumps({"a": {"solutions": ["\\boxed{4}"]},
                                   "b": {"solutions": ["x = 2, so \\boxed{2}", "\\boxed{2}"]},
                                   "c": {"solutions": ["four"]}, "d": {"solutions": ["\\boxed{1}"]}}))
    out, rep = convert_file(str(prompts), "auto", id2info_path=str(id2info))
    assert rep.fmt == "areal"
    assert [(r["prompt"], r["answer"]) for r in out] == [("What is 2+2?", "4"), ("Solve x+1=3.", "2")]
    assert out[0]["metadata"]["prompt_was_templated"] is True and out[1]["metadata"]["query_id"] == "b"
    assert rep.refused == {"query_id not in id2info": 1, "no \\boxed{} answer in any solution": 1,
                           "'prompt' missing or empty": 1, "invalid JSON": 1}


def test_areal_merged_rows_math_and_code() -> None:
    rows = _rows({"prompt": "m", "query_id": 1, "task": "math", "solutions": ["\\boxed{5}"]},
                 {"prompt": "c", "query_id": 2, "task": "code",
                  "input_output": json.dumps({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"})},
                 {"prompt": "s", "query_id": 3, "task": "code",
                  "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},
                 {"prompt": "e", "query_id": 5, "task": "code", "input_output": json.dumps({"inputs": [], "outputs": []})},
                 {"prompt": "x", "query_id": 4, "solutions": "\\boxed{1}"})
    out, rep = convert_rows(iter(rows), "areal")
    assert out[0]["answer"] == "5"
    assert out[1]["tests"] == {"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"}
    assert out[2]["tests"] == {"inputs": ["1 2\n"], "outputs": ["3\n"]}  # stdin/stdout cases, as the sandbox runs them
    assert rep.refused == {"'input_output' has no cases, or unequal inputs and outputs": 1, "'solutions' missing or not a list of strings": 1}


def test_code_layouts() -> None:
    from realscale.reward.code_tests import CallTests, CheckTests, parse_tests

    rows = _rows({"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(1, 2) == 3\n",
                  "entry_point": "add", "canonical_solution": "    return a + b\n"},
                 {"text": "Write square(x).", "test_list": ["assert square(3) == 9"], "code": "def square(x): return x*x"},
                 {"question": "Add.", "input_output": {"inputs": [[2, 2], [0, 1]], "outputs": [[4], [1]], "fn_name": "add"}},
                 {"prompt": "no tests"}, {"prompt": "bad", "test_list": [1]})
    out, rep = convert_rows(iter(rows), "code")
    assert out[0]["tests"] == {"test": rows[0][1]["test"], "entry_point": "add"}  # type: ignore[index]
    assert out[1]["tests"] == ["assert square(3) == 9"]
    assert rep.refused == {"no tests ('test' + 'entry_point', 'test_list' or 'input_output')": 1,
                           "'test_list' holds non-string tests": 1}
    assert isinstance(parse_tests(out[0]["tests"]), CheckTests) and isinstance(parse_tests(out[2]["tests"]), CallTests)
    sft, _ = convert_rows(iter(rows[:2]), "code", target="sft")
    assert sft[0]["response"].startswith("```python\ndef add(a, b):")


def test_detect_format_and_unknown() -> None:
    assert detect_format({"question": "q", "answer": "a\n#### 1"}) == "gsm8k"
    assert detect_format({"problem": "p", "solution": "s"}) == "math"
    assert detect_format({"problem": "p", "answer": "1", "solution": "s"}) == "deepscaler"
    assert detect_format({"Problem": "p", "Answer": 1}) == "aime"
    assert detect_format({"prompt": "p", "query_id": "1"}, has_id2info=True) == "areal"
    assert detect_format({"prompt": "p", "test_list": []}) == "code"
    assert detect_format({"prompt": "p", "answer": "1"}) == "recipe"
    with pytest.raises(ConvertError, match="cannot tell the format"):
        detect_format({"foo": 1})
    with pytest.raises(ConvertError, match="unknown format"):
        convert_rows(iter([]), "mmlu")
    assert unwrap_chat_markup("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n") == ("Hi", True)


def test_output_reads_as_a_dataset_and_heldout_is_disjoint(tmp_path: Path) -> None:
    src = tmp_path / "gsm.jsonl"
    src.write_text("\n".join(json.dumps({"question": f"q{i}?", "answer": f"so\n#### {i}"}) for i in range(10)) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "realscale", "data", "convert", str(src), "--out", str(out),
                           "--heldout", "3", "--instruction", "Box it."], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "10 rows read, 10 kept, 0 refused" in proc.stdout
    train = PromptDataset(str(out), shuffle=False, num_epochs=1)
    held = PromptDataset(str(tmp_path / "out.heldout.jsonl"), shuffle=False, num_epochs=1)
    assert len(train.samples) == 7 and len(held.samples) == 3 and train.stats["skipped"] == 0
    assert not {s.prompt for s in train.samples} & {s.prompt for s in held.samples}
    assert train.samples[0].prompt.endswith("\n\nBox it.")
    bad = subprocess.run([sys.executable, "-m", "realscale", "data", "convert", str(tmp_path / "nope.jsonl"),
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "input not found" in bad.stderr
    with pytest.raises(ConvertError, match="--heldout 5"):
        split_heldout([{}] * 5, 5, 0)


def test_gym_task_to_a_fixed_file_with_a_disjoint_heldout(tmp_path: Path) -> None:
    """``realscale data gym``: reasoning-gym's own generator (the real package), repeats
    refused so that no held-out question is trained on; the shipped chain_sum files are
    what the recipe's command makes."""
    pytest.importorskip("reasoning_gym")
    out = tmp_path / "cs.jsonl"
    args = ["chain_sum", "--size", "400", "--option", "min_terms=2", "--option", "max_terms=2",
            "--option", "min_digits=1", "--option", "max_digits=1", "--heldout", "20", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "realscale", "data", "gym", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "refused" in proc.stdout and "duplicate prompt" in proc.stdout  # 1-digit pairs repeat within 400 draws
    train = PromptDataset(str(out), shuffle=False, num_epochs=1)
    held = PromptDataset(str(tmp_path / "cs.heldout.jsonl"), shuffle=False, num_epochs=1)
    assert len(held.samples) == 20 and train.stats["skipped"] == 0
    prompts = [s.prompt for s in train.samples]
    assert len(set(prompts)) == len(prompts) and not set(prompts) & {s.prompt for s in held.samples}
    for s in train.samples:  # the gym's answer is the expression's value (checked, not trusted)
        expr = s.metadata["reasoning_gym"]["expression"]
        assert s.prompt.endswith(f"{expr} =") and int(s.answer) == eval(expr)  # noqa: S307 - "a + b" from the gym
        assert "gym_task" not in s.metadata  # scored by the math reward, like the held-out evaluation

    bad = subprocess.run([sys.executable, "-m", "realscale", "data", "gym", "chain_sum", "--size", "5", "--option",
                          "min_trms=2", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "min_trms" in bad.stderr
    with pytest.raises(ConvertError, match="expected name=value"):
        parse_gym_options(["min_terms"])
    assert parse_gym_options(["min_terms=2", "name=abc", "x=1.5"]) == {"min_terms": 2, "name": "abc", "x": 1.5}

    shipped = Path(__file__).resolve().parents[2] / "configs" / "data"
    remade = tmp_path / "remade.jsonl"
    subprocess.run([sys.executable, "-m", "realscale", "data", "gym", "chain_sum", "--size", "2600",
                    "--option", "min_terms=2", "--option", "max_terms=2", "--option", "min_digits=1",
                    "--option", "max_digits=2", "--heldout", "300", "--seed", "0", "--instruction",
                    "Give only the final number.", "--out", str(remade)],
                   check=True, capture_output=True, timeout=300)
    assert remade.read_text() == (shipped / "chain_sum.jsonl").read_text()
    assert (tmp_path / "remade.heldout.jsonl").read_text() == (shipped / "chain_sum.heldout.jsonl").read_text()

"""``realscale eval`` end to end: a warm-started tiny model on a benchmark file through a
real embedded generation server, scored by the math reward; the greedy answers are those
of the in-process engine, so the expected scores are known exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from realscale.config import load_config
from realscale.eval.benchmark import paired_change
from realscale.eval.metrics import mean_interval

pytestmark = pytest.mark.multiproc

SFT = ["sft.hidden_size=32", "sft.num_layers=1", "sft.num_heads=2", "sft.num_kv_heads=1", "sft.intermediate_size=64",
       "sft.lr=0.01", "sft.steps=12", "sft.batch_size=16", "sft.warmup_steps=2", "sft.eval_size=0",
       "data.task_max_operand=20", "data.task_heldout=40"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """A warm-started model and a benchmark whose answers are its own greedy answers on even
    rows and wrong numbers on odd rows."""
    from transformers import AutoTokenizer

    from realscale.eval import generate_completions
    from realscale.eval.benchmark import encode_prompt
    from realscale.reward.math_extract import extract_answer
    from realscale.launcher import ranks_backend
    from realscale.sft import run_sft
    from realscale.tasks.arith import task_from_config

    out = tmp_path_factory.mktemp("bench")
    cfg = load_config(None, [*SFT, f"run.output_dir={out}", "run.name=m"])
    model = run_sft(cfg, ranks_backend).model_dir
    tok = AutoTokenizer.from_pretrained(model)
    problems = task_from_config(cfg.data).split("heldout")[:24]
    texts = generate_completions(model, [encode_prompt(tok, p.prompt) for p in problems], max_new_tokens=8)
    rows = []
    for p, (text,) in zip(problems, texts):
        found = extract_answer(text)
        if found is not None:
            answer = found[0] if len(rows) % 2 == 0 else str(int(float(found[0].replace(",", ""))) + 1000)
            rows.append({"prompt": p.prompt, "answer": answer})
    assert len(rows) >= 4, texts  # the warm start answers with numbers
    path = out / "bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, str(path), rows, out


def test_benchmark_through_a_server_scores_known_answers(bench) -> None:
    model, data, rows, out = bench
    proc = subprocess.run([sys.executable, "-m", "realscale", "eval", "--model", model, "--data", data,
                           "--samples", "2", "--k", "1,2", "--temperature", "0", "--max-new-tokens", "8",
                           "--out", str(out / "ev"), f"run.output_dir={out}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "ev" / "summary.json").read_text())
    right = sum(1 for i in range(len(rows)) if i % 2 == 0) / len(rows)
    assert summary["num_problems"] == len(rows)
    for name in ("avg@2", "pass@1", "pass@2", "maj@2"):
        assert summary["metrics"][name] == pytest.approx(right), name
    records = [json.loads(line) for line in open(out / "ev" / "per_problem.jsonl")]
    assert [r["num_correct"] for r in records] == [2 if i % 2 == 0 else 0 for i in range(len(rows))]
    assert all(len(r["completions"]) == 2 and r["completions"][0] == r["completions"][1] for r in records)
    assert "avg@2" in proc.stdout and "maj@2" in proc.stdout and os.path.isfile(records and summary["per_problem"])
    # every answer was asked for at once (the per-server share, 2 x max_running_requests, is
    # larger than the benchmark), and the peak is logged
    assert summary["inflight_server_peak"] == summary["inflight_peak"] == 2 * len(rows), summary
    assert "requests in flight (peak)" in proc.stdout
    # the interval is over problems (right / wrong alternate), and printed beside avg@n
    per = [1.0 if i % 2 == 0 else 0.0 for i in range(len(rows))]
    assert summary["metrics"]["avg@2_ci95"] == pytest.approx(mean_interval(per)[1])
    assert summary["metrics"]["avg@2_ci95"] > 0
    assert f"± {100 * summary['metrics']['avg@2_ci95']:.1f}% (95%)" in proc.stdout
    # paired against itself: no change, no width; against a copy where one wrong problem
    # became right twice: +1/problems
    assert paired_change(str(out / "ev"), str(out / "ev")) == ("avg@2", 0.0, 0.0)
    records[1]["correct"] = [True, True]
    (out / "ev2").mkdir()
    (out / "ev2" / "per_problem.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    name, diff, half = paired_change(str(out / "ev"), str(out / "ev2"))
    assert (name, diff) == ("avg@2", pytest.approx(1 / len(rows))) and half > 0
    (out / "ev2" / "per_problem.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[1:]))
    assert paired_change(str(out / "ev"), str(out / "ev2")) is None  # not the same problems
    assert paired_change(str(out / "ev"), str(out / "nowhere")) is None


def test_eval_refuses_bad_settings(bench) -> None:
    model, data, _, out = bench
    proc = subprocess.run([sys.executable, "-m", "realscale", "eval", "--model", model, "--data", data,
                           "--samples", "2", "--k", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "eval.k: pass@4 needs 1 <= k <= eval.samples (2)" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "realscale", "eval", "--model", model, "--data",
                           str(out / "missing.jsonl")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "dataset file not found" in proc.stderr

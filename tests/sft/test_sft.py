"""SFT on the real Megatron engine (a few steps, a very small model) and evaluation
through the embedded generation engine, checked against Hugging Face directly."""

from __future__ import annotations

import json
import os

import pytest
import torch

from realscale.config import load_config
from realscale.tasks.arith import encode_example, is_correct, prompt_ids, task_from_config

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]  # SFT runs

OVERRIDES = ["sft.hidden_size=32", "sft.num_layers=1", "sft.num_heads=2", "sft.num_kv_heads=1",
             "sft.intermediate_size=64", "sft.lr=0.01", "sft.steps=12", "sft.batch_size=16", "sft.warmup_steps=2",
             "sft.eval_size=12", "data.task_max_operand=20", "data.task_heldout=40"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    from realscale.launcher import ranks_backend
    from realscale.sft import run_sft

    out = tmp_path_factory.mktemp("sft")
    cfg = load_config(None, [*OVERRIDES, f"run.output_dir={out}", "run.name=t"])
    return cfg, run_sft(cfg, ranks_backend)


def _answer_nll(model_dir: str, cfg) -> float:
    """Token-mean NLL of the answers of 32 training examples under an HF model (independent of Megatron)."""
    from hf_nll import hf_masked_nll

    return hf_masked_nll(model_dir, encode_example, task_from_config(cfg.data).split("train")[:32])


def test_sft_lowers_the_answer_nll_and_writes_a_loadable_model(sft_run) -> None:
    cfg, result = sft_run
    assert result.steps == 12 and result.last_loss < result.first_loss
    out = result.model_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "config.yaml",
                 "sft.json", "eval.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    # HF, not Megatron, scores the saved weights: the training really reached the files.
    assert _answer_nll(out, cfg) < 0.85 * _answer_nll(os.path.join(out, "base"), cfg)
    assert 0.0 <= result.heldout_accuracy <= 1.0
    with open(os.path.join(out, "eval.json"), encoding="utf-8") as fh:
        assert json.load(fh)["accuracy"] == result.heldout_accuracy


def test_eval_matches_hf_greedy_decoding(sft_run) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from realscale.eval import evaluate

    cfg, result = sft_run
    problems = task_from_config(cfg.data).split("heldout")[:10]
    ev = evaluate(result.model_dir, problems, max_new_tokens=6, keep_examples=len(problems))
    tok = AutoTokenizer.from_pretrained(result.model_dir)
    model = AutoModelForCausalLM.from_pretrained(result.model_dir, dtype=torch.float32).eval()
    expected = []
    for p in problems:
        ids = prompt_ids(tok, p.prompt)
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        expected.append(tok.decode(out[0, len(ids):], skip_special_tokens=True))
    assert [ex["completions"][0] for ex in ev.examples] == expected
    assert ev.accuracy == sum(is_correct(t, p.answer) for t, p in zip(expected, problems)) / len(problems)


def test_sampling_reports_pass_at_k_and_mixed_groups(sft_run) -> None:
    from realscale.eval import evaluate

    cfg, result = sft_run
    problems = task_from_config(cfg.data).split("heldout")[:6]
    ev = evaluate(result.model_dir, problems, samples=4, temperature=1.0, max_new_tokens=6, keep_examples=6)
    verdicts = [[is_correct(t, ex["answer"]) for t in ex["completions"]] for ex in ev.examples]
    assert all(len(v) == 4 for v in verdicts)
    assert ev.accuracy == sum(map(sum, verdicts)) / 24
    assert ev.pass_at_k == sum(map(any, verdicts)) / 6
    assert ev.mixed_fraction == sum(any(v) and not all(v) for v in verdicts) / 6

"""SFT on real demonstrations (the GSM8K solutions in configs/data): the response-only
mask, the loss falling on the Megatron engine (checked again by HF on the exported
model), two data-parallel ranks against one, and a two-stage recipe from one call."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from realscale.config import load_config

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "data", "gsm8k_mgsm_sft.jsonl")
MODEL = ["sft.hidden_size=32", "sft.num_layers=1", "sft.num_heads=2", "sft.num_kv_heads=1",
         "sft.intermediate_size=64", "sft.warmup_steps=1", "sft.lr=0.01", "sft.batch_size=8",
         "train.max_tokens_per_micro_batch=2048", f"sft.data={DATA}", "sft.max_seq_len=1200"]


def _tokenizer():
    from transformers import AutoTokenizer

    from realscale.models.tiny import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))


def test_response_only_mask_for_pairs_and_chats() -> None:
    from realscale.data.sft_data import encode_messages, encode_pair
    from realscale.data.tokens import prompt_ids

    tok = _tokenizer()
    ids, mask = encode_pair(tok, "What is 2+2?", "2+2 is \\boxed{4}.")
    head = prompt_ids(tok, "What is 2+2?")
    assert ids[: len(head)] == head and mask[: len(head)] == [0.0] * len(head)  # the RL prompt layout, unmasked
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "2+2 is \\boxed{4}." + tok.eos_token
    assert all(mask[len(head):])
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    ids, mask = encode_messages(tok, chat)
    assert tok.decode(ids) == tok.apply_chat_template(chat, tokenize=False)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello!<|im_end|>\n4<|im_end|>\n"


def test_bad_rows_are_refused_and_counted(tmp_path: Path) -> None:
    from realscale.data.sft_data import load_demonstrations

    rows = [{"prompt": "p", "response": "r"}, {"prompt": "p"}, {"messages": [{"role": "user", "content": "x"}]},
            {"messages": "hi"}, {"prompt": "long", "response": "y" * 500}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{oops\n")
    examples, refused = load_demonstrations(str(path), _tokenizer(), max_seq_len=200)
    assert len(examples) == 1
    assert refused == {"'response' missing or empty": 1, "'messages' has no assistant turn to learn": 1,
                       "'messages' must be a list of {role, content} objects": 1,
                       "longer than max_seq_len=200 tokens": 1, "invalid JSON": 1}


def _hf_nll(model_dir: str, n: int = 6) -> float:
    """Response-token NLL of the first n demonstrations under HF (independent of Megatron)."""
    from hf_nll import hf_masked_nll

    from realscale.data.sft_data import encode_pair

    rows = [json.loads(line) for line in open(DATA).readlines()[:n]]
    return hf_masked_nll(model_dir, lambda tok, r: encode_pair(tok, r["prompt"], r["response"]), rows)


@pytest.mark.multiproc
def test_loss_falls_on_real_data_and_two_dp_ranks_match_one(tmp_path: Path) -> None:
    from realscale.launcher import ranks_backend
    from realscale.sft import run_sft

    runs = {}
    for dp in (1, 2):
        cfg = load_config(None, [*MODEL, "sft.steps=6", f"parallel.dp={dp}", f"run.output_dir={tmp_path}",
                                 f"run.name=dp{dp}"])
        runs[dp] = run_sft(cfg, ranks_backend)
    one, two = runs[1], runs[2]
    assert one.heldout_accuracy is None and one.stages[0]["examples"] == 60 and one.stages[0]["refused"] == {}
    assert one.last_loss < 0.9 * one.first_loss
    # each stage's ranks came from the launcher (its dist env), on the backend device.py picks
    assert [(r.stages[0]["world_size"], r.stages[0]["backend"]) for r in (one, two)] == [(1, "gloo"), (2, "gloo")]
    # same global batches, token-mean loss over both ranks: the same training
    losses1 = json.load(open(os.path.join(one.model_dir, "sft.json")))["losses"]
    losses2 = json.load(open(os.path.join(two.model_dir, "sft.json")))["losses"]
    assert losses2 == pytest.approx(losses1, rel=1e-4)
    assert _hf_nll(one.model_dir) < 0.9 * _hf_nll(os.path.join(one.model_dir, "base"))


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_stage_recipe_from_one_call(tmp_path: Path) -> None:
    from realscale.launcher import ranks_backend
    from realscale.sft import run_sft

    cfg = load_config(None, [*MODEL, "sft.steps=3", f"run.output_dir={tmp_path}", "run.name=st",
                             "sft.stages=[{name: short, max_seq_len: 600}, {max_seq_len: 1200, steps: 4}]"])
    res = run_sft(cfg, ranks_backend)
    short, full = res.stages
    assert short["dir"].endswith(os.path.join("sft", "short")) and full["dir"] == res.model_dir
    assert short["steps"] == 3 and full["steps"] == 4 and res.steps == 7
    assert short["refused"].get("longer than max_seq_len=600 tokens", 0) > 0 and full["refused"] == {}
    assert short["examples"] + short["refused"]["longer than max_seq_len=600 tokens"] == 60
    # stage 2 starts from stage 1's export, not from the base model
    assert full["first_loss"] < short["first_loss"]
    for d in (short["dir"], full["dir"]):
        assert os.path.isfile(os.path.join(d, "model.safetensors")) and os.path.isfile(os.path.join(d, "chat_template.jinja"))

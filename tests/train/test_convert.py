"""HF <-> megatron conversion: logits equal to HF at every layout, and exact round trips.

All three families run in one set of processes per layout (spawning ranks and importing
megatron costs seconds each)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine_cases as cases
from realscale.models.tiny import resolve_model_path
from realscale.parallel.spawn import run_distributed

pytestmark = pytest.mark.multiproc

FAMILIES = ["tiny-qwen2", "tiny-qwen3", "tiny-llama"]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=["tp1", "tp2", "pp2", "tp2xpp2"])
def test_logits_match_hf(tp: int, pp: int) -> None:
    jobs = [("logits_diff", (resolve_model_path(m), tp, pp)) for m in FAMILIES]
    per_rank = run_distributed(cases.run_many, tp * pp, jobs, timeout=600)
    for j, model in enumerate(FAMILIES):
        diffs = [r[j]["diff"] for r in per_rank if r[j]["diff"] is not None]
        assert len(diffs) == tp  # every rank of the last stage reports
        assert max(diffs) < 1e-4, f"{model} tp={tp} pp={pp}: max |logits diff| {max(diffs):.2e}"


def test_roundtrip_tp2_pp2_is_bit_identical(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    jobs = [("roundtrip", (resolve_model_path(m), 2, 2, str(tmp_path / m))) for m in FAMILIES]
    run_distributed(cases.run_many, 4, jobs, timeout=600)
    for model in FAMILIES:
        src, out = resolve_model_path(model), tmp_path / model
        a, b = load_file(f"{src}/model.safetensors"), load_file(str(out / "model.safetensors"))
        a = {k: v for k, v in a.items() if k != "lm_head.weight" or k in b}  # tied heads are not stored twice
        assert sorted(a) == sorted(b), (model, set(a) ^ set(b))
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (model, name)

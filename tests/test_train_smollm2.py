"""`realscale train configs/smollm2_chain_sum_cpu.yaml`: a real pretrained model
(SmolLM2-135M-Instruct) measurably learns a real public task (reasoning-gym's chain_sum)
on this 2-core machine (slow: about an hour; BENCHMARKS.md, "A real pretrained model learns").

The criterion is the one the recipe is for: the held-out sampled accuracy of the final
model against the starting model's, paired per problem over the same 300 held-out
problems (:func:`realscale.eval.benchmark.paired_change`), rises by more than its 95%
interval; and the run wrote its exports for the learning curve.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from realscale.models.gguf import INSTALL_HINT, missing_requirements

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(7200)]

REPO = Path(__file__).resolve().parents[1]
MISSING = missing_requirements()
if MISSING:
    pytest.skip(f"the SmolLM2 recipe needs {', '.join(MISSING)} ({INSTALL_HINT})", allow_module_level=True)


def test_smollm2_learns_chain_sum(tmp_path: Path) -> None:
    from realscale.eval.benchmark import paired_change

    out = subprocess.run([sys.executable, "-m", "realscale", "train",
                          str(REPO / "configs" / "smollm2_chain_sum_cpu.yaml"), f"run.output_dir={tmp_path}"],
                         cwd=REPO, capture_output=True, text=True, timeout=7100)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "smollm2_chain_sum"
    change = paired_change(str(run / "eval_start"), str(run / "eval_final"))
    assert change is not None
    name, diff, half = change
    assert diff > half > 0, f"{name}: {100 * diff:+.1f} ± {100 * half:.1f} points"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["accuracy_end"]["avg@2"] > summary["accuracy_start"]["avg@2"]
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step_000016", "step_000032"]

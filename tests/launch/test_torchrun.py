"""Without Slurm: the same trainer ranks bootstrap under torchrun (2 gloo ranks, dp=2)
from the run spec, against a real embedded generation server, and export the trained
weights themselves at the end; an SFT stage's ranks (tp=2) bootstrap the same way from a
spec naming the SFT entry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]

@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH (it ships with torch)")
def test_two_ranks_under_torchrun(tmp_path: Path, tiny_run_args) -> None:
    from realscale.config import load_config
    from realscale.launcher import start_servers, stop_servers
    from realscale.launcher.spec import RunSpec, spec_path
    from realscale.models.tiny import resolve_model_path

    out = tmp_path / "run"
    cfg = load_config(None, [*tiny_run_args(2, 1, "parallel.dp=2"), f"run.output_dir={tmp_path}", "run.name=run"])
    model = resolve_model_path(cfg.model.path)
    servers = start_servers(model, 1, str(out / "logs"))
    try:
        spec = RunSpec(asdict(cfg), model, str(out), [s.url for s in servers]).save(spec_path(str(out)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        res = subprocess.run(["torchrun", "--standalone", "--nproc-per-node=2", "-m", "realscale", "rank", "--spec",
                              spec], env=env, capture_output=True, text=True, timeout=400)
    finally:
        stop_servers(servers)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2]
    assert (out / "latest_checkpoint").read_text().strip().endswith("step000002")
    # rank 0 drove the rollouts (one driver), both ranks trained (dp=2 shares the batch)
    assert all(m["rollout/trajectories"] == 4.0 for m in metrics if "train/loss" in m)
    # the torchrun ranks wrote the end-of-run export themselves, after the last step
    record = json.loads((out / "final" / "export.json").read_text())
    assert record == {"step": 2, "world_size": 2, "backend": "gloo", "layout": {"tp": 1, "pp": 1, "dp": 2}}
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH (it ships with torch)")
def test_sft_ranks_under_torchrun(tmp_path: Path) -> None:
    """``realscale rank`` with an SFT spec: the stage's two ranks take RANK / LOCAL_RANK /
    WORLD_SIZE from torchrun and the backend from parallel.backend, train tp=2 and write
    the HF directory (rank 0) and the stage's record."""
    from realscale.config import load_config
    from realscale.launcher.spec import RunSpec, entry_name, spec_path
    from realscale.models.tiny import resolve_model_path
    from realscale.sft import sft_rank

    out = tmp_path / "sft"
    cfg = load_config(None, ["parallel.tp=2", "sft.steps=3", "sft.batch_size=8", "sft.warmup_steps=1",
                             "data.task_max_operand=20", f"sft.output={out / 'model'}"])
    spec = RunSpec(asdict(cfg), resolve_model_path("tiny-qwen2"), str(out), [], entry=entry_name(sft_rank)).save(
        spec_path(str(out), "sft"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["torchrun", "--standalone", "--nproc-per-node=2", "-m", "realscale", "rank", "--spec",
                          spec], env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    stage = json.loads((out / "model" / "sft_stage.json").read_text())
    assert (stage["world_size"], stage["backend"], len(stage["losses"])) == (2, "gloo", 3)
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()


def test_rank_without_spec_is_a_one_line_error(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "realscale", "rank", "--spec", str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2
    assert res.stderr.strip().startswith("realscale: error: run spec not found:"), res.stderr

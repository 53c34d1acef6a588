"""`realscale train` keeps its storage bounded: checkpoint rotation with a pinned step,
disk weight updates that keep only the version every server has loaded, and the disk
use reported per step and in the summary; HF snapshots every k steps (run.export_every)
for a learning curve, the last step's being the final export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(900)]  # a whole run: ~2-4 min

ARGS = ["model.path=tiny-qwen2", "data.source=task:arith", "run.total_steps=4", "run.checkpoint_every=1",
        "run.keep_checkpoints=2", "run.pin_checkpoints=[1]", "run.export_every=2", "generate.weight_update=disk", "generate.num_servers=2",
        "rollout.batch_size=2", "rollout.n_samples=2", "rollout.max_staleness=1", "generate.max_new_tokens=4",
        "train.max_tokens_per_micro_batch=512", "rollout.filter_all_equal=false"]


def test_rotation_weight_pruning_and_disk_report(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "realscale", "train", f"run.output_dir={tmp_path}", "run.name=s",
                           *ARGS], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = tmp_path / "s"
    assert sorted(os.listdir(run / "checkpoints")) == ["step000001", "step000003", "step000004"]
    assert os.listdir(run / "weights") == ["v4"]  # both servers loaded v4, so v1..v3 are gone
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r for r in records if "disk/run_bytes" in r]
    assert len(steps) == 4 and all(r["disk/free_bytes"] > 0 for r in steps)
    assert steps[-1]["disk/checkpoints_bytes"] > 0  # logged after step 3's checkpoint, before step 4's
    # the servers really served every new version: the last step trained tokens of version >= 2
    assert max(r["version"] for r in records if "version" in r) == 4
    summary = json.loads((run / "summary.json").read_text())
    assert summary["disk"]["disk/weights_bytes"] > 0
    assert "disk use:" in proc.stdout and "checkpoints" in proc.stdout
    # snapshots at steps 2 (and not 4: the final export is that one), each whole, marked
    from safetensors.torch import load_file

    assert os.listdir(run / "exports") == ["step_000002"]
    snap = run / "exports" / "step_000002"
    assert json.loads((snap / "export.json").read_text())["step"] == 2 and (snap / "config.json").exists()
    mid, final = load_file(str(snap / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    assert {n: (t.shape, t.dtype) for n, t in mid.items()} == {n: (t.shape, t.dtype) for n, t in final.items()}

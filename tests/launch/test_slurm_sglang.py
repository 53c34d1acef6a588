"""`sbatch launch/slurm/ppo_tiny.sh generate.backend=sglang` on the real one-node Slurm
cluster (.ci/slurm_up.sh): the server job step execs the real SGLang server (SGLang-on-CPU,
``launcher.roles._exec_engine``), the trainer step's two tasks publish every step's weights
into it over SGLang's weight group (gloo), and the job completes.

In the ``sglang`` tier: run from the venv of scripts/sglang_cpu/install.sh (the job's
python is this one, ``REALSCALE_PYTHON``). Skipped, with the reason, where no Slurm
controller answers.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from run_records import assert_each_prompt_trained_once
from test_slurm_job import _ended, _finish, _submit

pytestmark = [pytest.mark.sglang, pytest.mark.multiproc, pytest.mark.usefixtures("slurm"), pytest.mark.timeout(900)]

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed here: bash scripts/sglang_cpu/install.sh, then run pytest from its venv",
                allow_module_level=True)


def test_slurm_job_with_sglang_server(tmp_path: Path) -> None:
    total = 3
    run = tmp_path / "ppo_tiny"
    proc, job = _submit(tmp_path, "generate.backend=sglang", f"run.total_steps={total}", "run.checkpoint_every=100",
                        "generate.context_length=256", "launch.health_timeout=600")
    rc = _finish(proc, job, timeout=800)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert rc == 0 and _ended(job, 60)["JobState"] == "COMPLETED", log[-4000:]
    assert_each_prompt_trained_once(run, total)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert all(m["perf/weight_sync_bytes"] > 0 for m in trained[1:]), trained
    server_logs = "".join(p.read_text(errors="replace") for p in run.glob("logs/*server*"))
    assert "server_args={'model_path'" in server_logs + log, (server_logs + log)[-3000:]  # SGLang's start-up line

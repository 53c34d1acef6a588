"""``realscale simulate`` and ``realscale profile --show`` from the command line."""

from __future__ import annotations

import json

import pytest

from realscale.cli import main
from realscale.planner.hardware import GPU, Efficiency, HardwareProfile


@pytest.fixture()
def cpu_profile(tmp_path) -> str:
    """A CPU-like profile (numbers of the order `realscale profile` measures on 2 cores)."""
    eff = Efficiency(mfu_train=0.3, mfu_prefill=0.2, mfu_decode=0.2, hbm_decode=1.0, link=1.0, tp_overhead=0.0,
                     collective_latency_s=0.0, decode_step_overhead_s=1.5e-3, decode_seq_overhead_s=1e-4,
                     train_step_overhead_s=0.03, weight_update_overhead_s=0.03)
    path = tmp_path / "cpu.json"
    HardwareProfile("cpu", GPU("cpu", 0.04, 24.0, 0.01, 10.0, 10.0, 10.0), eff).save(str(path))
    return str(path)


def test_simulate_a_cpu_recipe(cpu_profile: str, capsys) -> None:
    assert main(["simulate", "configs/long_tail_cpu.yaml", "--profile", cpu_profile, "--steps", "6", "--warmup", "1",
                 "--accept", "0.5", "--json", "--timeline"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["runs"]) == {"eta=4", "eta=0"}
    a, s = out["runs"]["eta=4"], out["runs"]["eta=0"]
    assert a["tokens_per_s"] > s["tokens_per_s"] > 0
    assert len(a["timeline"]) == 6 and max(int(k) for k in a["staleness_hist"]) <= 4
    assert "task mix" in out["lengths"]


def test_simulate_a_gpu_recipe_replanned(capsys) -> None:
    assert main(["simulate", "configs/r1_distill_qwen_1.5b_math.yaml", "rollout.batch_size=32", "--gpus", "32",
                 "--profile", "H800", "--lengths", "lognormal:1500:0.6", "--steps", "4", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "disaggregated" in out and "gpus: 32" in out and "async / sync" in out


def test_simulate_with_measured_transfer_terms(cpu_profile: str, capsys, tmp_path) -> None:
    """--weight-sync measured reads the resharder's benchmark; --batch-path measured:FILE a
    batch-transfer result; both are named, with their kind, in the output."""
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"rows": [{"method": "scatter", "batch_bytes": b, "tokens": b // 24,
                                           "seconds": 1e-3 + b * 1e-9} for b in (24_000, 2_400_000)]}))
    assert main(["simulate", "configs/long_tail_cpu.yaml", "--profile", cpu_profile, "--steps", "4", "--warmup", "1",
                 "--weight-sync", "measured", "--batch-path", f"measured:{batch}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "measured" in out["weight_sync"] and "bench_weight_sync" in out["weight_sync"]
    assert "measured" in out["batch_path"] and "batch.json" in out["batch_path"]
    assert main(["simulate", "configs/long_tail_cpu.yaml", "--profile", cpu_profile, "--weight-sync", "fast"]) == 2
    assert "--weight-sync fast" in capsys.readouterr().err


def test_simulate_errors_are_one_line(capsys, tmp_path) -> None:
    assert main(["simulate", "launch/slurm/plans/ppo_7b.yaml"]) == 2
    assert "--recipe" in capsys.readouterr().err
    assert main(["simulate", "configs/tiny_cpu.yaml", "--profile", str(tmp_path / "none.json")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["simulate", "configs/tiny_cpu.yaml", "--profile", "H100", "--lengths", "zipf:3"]) == 2
    assert "--lengths zipf:3" in capsys.readouterr().err


def test_profile_show(capsys) -> None:
    assert main(["profile", "--show", "A100"]) == 0
    out = capsys.readouterr().out
    assert "gpu.peak_tflops" in out and "published" in out and "assumed" in out

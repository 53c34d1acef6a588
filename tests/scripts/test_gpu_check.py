"""The GPU verification script's CPU dry run (issue 33): ``scripts/gpu_check.py --device cpu --quick``.

The script is written for a GPU machine that is lent only now and then; running it here
keeps it from rotting in between. Every item must report a status; those that run on a
CPU (the engine against HF, a train step, the layer stack, the embedded server, the
colocated end-to-end run) must be ok *with* figures and passing checks; those that need
CUDA (nvcc kernels, NCCL) are skipped with a reason, while the checks they still run here
(the C++ CPU kernels against their twins, the collectives on gloo under the device
contract) must pass.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"

pytestmark = pytest.mark.timeout(600)


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gc() -> Any:
    return _script()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("gpu_check")
    out = base / "out"
    start = time.monotonic()
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out), "--scratch",
                          str(base / "scratch")], capture_output=True, text=True, timeout=540, cwd=base)
    wall = time.monotonic() - start
    path = out / "gpu_check.json"
    assert path.exists(), (res.stdout + res.stderr)[-4000:]
    rep = json.loads(path.read_text())
    rep["_rc"], rep["_wall"], rep["_output"] = res.returncode, wall, (res.stdout + res.stderr)[-4000:]
    rep["_table"] = (out / "gpu_check.txt").read_text()
    return rep


def _item(report: dict[str, Any], name: str) -> dict[str, Any]:
    return report["items"][name]


def test_every_item_reports_a_status_and_the_run_passes(report: dict[str, Any], gc: Any) -> None:
    assert set(report["items"]) == set(gc.ITEMS)
    assert gc.validate_report(report) == [], report["_table"]
    assert report["form_problems"] == []
    failed = {n: r["reason"] for n, r in report["items"].items() if r["status"] == "failed"}
    assert not failed, report["_table"]
    assert report["_rc"] == 0, report["_output"]
    assert report["wall_s"] < report["budget_s"] and report["quick"] is True and report["device"] == "cpu"
    for name in gc.ITEMS:  # the short table names every item with its status
        assert any(line.startswith(f"{name} ") and _item(report, name)["status"] in line
                   for line in report["_table"].splitlines()), report["_table"]


def test_cpu_items_are_ok_with_figures(report: dict[str, Any]) -> None:
    for name in ("env", "engine", "layer_stack", "server", "e2e"):
        rec = _item(report, name)
        assert rec["status"] == "ok", (name, rec["reason"])
        assert rec["figures"] and rec["summary"], name
        if name != "env":
            assert rec["checks"] and all(c["ok"] for c in rec["checks"].values()), (name, rec["checks"])


def test_engine_log_probs_match_hf_and_a_step_trains(report: dict[str, Any]) -> None:
    f = _item(report, "engine")["figures"]
    fp32, bf16 = f["tiny-qwen2/float32"], f["tiny-qwen2/bfloat16"]
    assert fp32["max_abs_diff_vs_hf"] < 1e-4  # what tests/train/test_engine.py holds the engine to
    assert bf16["max_abs_diff_vs_hf"] < 0.1 and bf16["param_dtype"] == "torch.bfloat16"
    for case in (fp32, bf16):
        assert case["update_ok"] == 1.0 and case["train_grad_norm"] > 0
        assert case["logprob_change_after_step"] > 1e-4
        assert case["micro_batches"] > 1  # the packed batch was split under the token budget


def test_layer_stack_measures_throughput_against_a_measured_peak(report: dict[str, Any]) -> None:
    f = _item(report, "layer_stack")["figures"]
    assert f["peak"]["tflops"] > 0 and f["tokens_per_s"] > 0
    assert 0 < f["mfu"] < 1.5
    assert f["sequences"] > 1 and f["tokens"] > f["micro_batch_tokens"]  # packed, several micro-batches


def test_server_decodes_at_three_batch_sizes_and_pauses(report: dict[str, Any]) -> None:
    f = _item(report, "server")["figures"]
    for bs in (1, 16, 64):
        d = f[f"decode_batch{bs}"]
        assert d["tokens"] == bs * f["new_tokens"] and d["tokens_per_s"] > 0
    assert len(f["pause_latency_ms"]["retract"]) == 3 and f["pause_latency_ms_median_retract"] > 0
    assert f["after_pause"]["retractions"] >= 16


def test_colocated_run_trains_on_the_trainers_weights(report: dict[str, Any]) -> None:
    f = _item(report, "e2e")["figures"]
    assert f["rc"] == 0 and "parallel.mode=colocated" in f["command"]
    assert [s["step"] for s in f["steps"]] == [1, 2]
    assert all(abs(s["train/behav_kl"]) <= f["behav_kl_tol"] for s in f["steps"])


def test_cuda_items_are_skipped_with_a_reason_and_their_cpu_checks_pass(report: dict[str, Any]) -> None:
    kernels = _item(report, "kernels")
    assert kernels["status"] == "skipped" and "CUDA" in kernels["reason"]
    assert all(c["ok"] for c in kernels["checks"].values()), kernels["checks"]
    coll = _item(report, "collectives")
    assert coll["status"] == "skipped" and "NCCL" in coll["reason"]
    checks = coll["checks"]
    assert checks and all(c["ok"] for c in checks.values()), checks
    for name in ("all_reduce on the comm device", "batch scatter delivers the mini-batches",
                 "publish 0: generation weights equal the trainer's", "publish 1: generation weights equal the trainer's"):
        assert name in checks, sorted(checks)
    assert coll["figures"]["backend"] == "gloo"
    assert {x["what"] for x in report["not_run"]} >= {"kernels", "collectives"}


def test_the_form_check_refuses_a_silent_ok(report: dict[str, Any], gc: Any) -> None:
    """The dry run's own check can fail: an item reported ok without figures, ok with a
    failed check, a skip without a reason or a missing item are all refused."""
    def doctored(edit: Any) -> list[str]:
        rep = copy.deepcopy(report)
        edit(rep)
        return gc.validate_report(rep)

    assert doctored(lambda r: r["items"]["engine"].update(figures={}))
    assert doctored(lambda r: r["items"]["server"].update(checks={}))
    assert doctored(lambda r: r["items"]["e2e"]["checks"].update(x={"ok": False, "detail": None}))
    assert doctored(lambda r: r["items"]["kernels"].update(reason=""))
    assert doctored(lambda r: r["items"].pop("layer_stack"))
    assert doctored(lambda r: r["items"]["env"].update(status="fine"))


def test_a_failed_check_or_an_exception_fails_the_item(gc: Any) -> None:
    it = gc.Item("x", 10)
    it.figures["a"] = 1.0
    it.check("good", True)
    assert it.record()["status"] == "ok"
    it.check("bad", False, "3 > 2")
    rec = it.record()
    assert rec["status"] == "failed" and "bad (3 > 2)" in rec["reason"] and rec["figures"] == {"a": 1.0}
    rec = gc.Item("y", 10).record(error="RuntimeError: boom")
    assert rec["status"] == "failed" and rec["reason"] == "RuntimeError: boom"
    skipped = gc.Item("z", 10)
    skipped.skip("no GPU")
    assert skipped.record()["status"] == "skipped"


def test_a_crash_or_a_hang_loses_only_its_own_item(tmp_path: Path) -> None:
    """One item kills its worker, the next hangs past its budget: each is failed with the
    reason and the check it recorded before, and the item after them still runs."""
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_FAULT": "env:crash,layer_stack:hang"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--items", "env,layer_stack,kernels",
                          "--item-budget", "layer_stack=5", "--out", str(out), "--scratch", str(tmp_path / "scratch")],
                         capture_output=True, text=True, timeout=400, env=env)
    assert res.returncode == 1, (res.stdout + res.stderr)[-3000:]  # an item failed
    items = json.loads((out / "gpu_check.json").read_text())["items"]
    assert items["env"]["status"] == "failed" and "died (exit code 3)" in items["env"]["reason"]
    assert items["layer_stack"]["status"] == "failed" and "timed out" in items["layer_stack"]["reason"]
    for name in ("env", "layer_stack"):  # what the item had recorded survives its end
        assert items[name]["checks"] == {"before the injected fault": {"ok": True, "detail": None}}, items[name]
    assert items["kernels"]["status"] == "skipped" and "no CUDA device" in items["kernels"]["reason"]  # it ran
    assert all(c["ok"] for c in items["kernels"]["checks"].values())
    assert items["engine"]["status"] == "skipped" and items["engine"]["reason"] == "not among --items"

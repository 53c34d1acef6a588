"""Hardware profiles: every constant labelled, JSON round trip, the CPU fit recovers what
generated the measurements, and the planner plans on a profile."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from realscale.cli import main
from realscale.parallel.mesh import Strategy
from realscale.parallel.model_spec import spec_from_hf_config
from realscale.planner import cost as C
from realscale.launcher.calibrate import (DECODE_BATCHES, DECODE_PROMPTS, REQUEST_BATCHES, TRAIN_POINTS, fit_profile,
                                         nelder_mead)
from realscale.planner.hardware import (GPU, PROFILES, SOURCE_KINDS, Efficiency, HardwareError, HardwareProfile,
                                        builtin_profile, load_profile)

TINY = {"model_type": "qwen2", "vocab_size": 264, "hidden_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 384, "tie_word_embeddings": True}


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_constant_of_a_gpu_profile_has_a_source(name: str) -> None:
    prof = builtin_profile(name)
    keys = [f"gpu.{f.name}" for f in dataclasses.fields(GPU) if f.name != "name"]
    keys += [f"eff.{f.name}" for f in dataclasses.fields(Efficiency)]
    for key in keys:
        assert key in prof.sources, f"{name}: {key} has no source"
        assert prof.sources[key].kind in SOURCE_KINDS and prof.sources[key].ref
    assert prof.sources["gpu.peak_tflops"].kind == ("assumed" if name == "cpu" else "published")


def test_profile_json_round_trip_and_errors(tmp_path) -> None:
    prof = builtin_profile("H100")
    path = tmp_path / "p.json"
    prof.save(str(path))
    assert load_profile(str(path)) == prof
    with pytest.raises(HardwareError, match="not found"):
        load_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(HardwareError, match="not JSON"):
        load_profile(str(bad))
    bad.write_text('{"name": "x"}')
    with pytest.raises(HardwareError, match="not a hardware profile"):
        load_profile(str(bad))


def _synthetic(spec, gpu: GPU, eff: Efficiency) -> tuple[list, list, dict]:
    """Measurements as the cost model with ``eff`` would have produced them."""
    decode = []
    for b in DECODE_BATCHES:
        for p in DECODE_PROMPTS:
            step = C.decode_step_seconds(spec, 1, b, p + 28, gpu, eff)
            pre = b * eff.request_overhead_s + b * p * C.fwd_flops_per_token(spec, DECODE_PROMPTS[1]) \
                / (gpu.peak_tflops * 1e12 * eff.mfu_prefill)
            decode.append({"batch": b, "prompt": p, "ctx": p + 28, "step_s": step, "prefill_tokens": b * p,
                           "prefill_s": pre})
    train = []
    for tokens, seq_len, mb in TRAIN_POINTS:
        w = C.Workload(batch=tokens // seq_len, n_samples=1, prompt_len=16, gen_len=seq_len - 16,
                       mean_gen_len=seq_len - 16, train_mb_tokens=512, minibatches=mb)
        train.append({"tokens": tokens, "seq_len": seq_len, "prompt_len": 16, "minibatches": mb,
                      "seconds": C.train_cost(spec, Strategy(1, 1, 1), w, gpu, eff, 1).seconds})
    sync = {"seconds": eff.weight_update_overhead_s + spec.n_params * spec.itemsize / (gpu.nvlink_gbps * 1e9)}
    return decode, train, sync


DEVICE = {"matmul_gflops": 40.0, "copy_gbps": 8.0, "memory_gb": 24.0, "cpus": 2}
SETTINGS = {"train_mb_tokens": 512, "logprob_chunk_tokens": 1024}


def _measured(request_overhead_s: float):  # noqa: ANN202 - (spec, decode, train, sync)
    """Synthetic measurements of a CPU-like device with known constants."""
    spec = spec_from_hf_config(TINY, itemsize=4)
    gpu = GPU("cpu", 0.04, 24.0, 0.008, 8.0, 8.0, 8.0)
    truth = Efficiency(mfu_train=0.3, mfu_prefill=0.2, mfu_decode=0.25, hbm_decode=1.0, link=1.0, tp_overhead=0.0,
                       collective_latency_s=0.0, decode_step_overhead_s=2e-3, decode_seq_overhead_s=5e-5,
                       train_step_overhead_s=0.05, request_overhead_s=request_overhead_s, weight_update_overhead_s=0.02)
    return (spec, *_synthetic(spec, gpu, truth))


def test_cpu_fit_recovers_the_constants_that_made_the_measurements() -> None:
    spec, decode, train, sync = _measured(1e-3)
    prof = fit_profile("cpu", spec, DEVICE, decode, train, sync, SETTINGS)
    e = prof.eff
    for d in decode:  # the fitted model reproduces every measured step
        assert C.decode_step_seconds(spec, 1, d["batch"], d["ctx"], prof.gpu, e) == pytest.approx(d["step_s"], rel=0.03)
    assert e.decode_step_overhead_s == pytest.approx(2e-3, rel=0.1)
    assert e.mfu_train == pytest.approx(0.3, rel=0.05)
    assert e.train_step_overhead_s == pytest.approx(0.05, rel=0.1)
    assert e.request_overhead_s == pytest.approx(1e-3, rel=0.05)
    assert e.mfu_prefill == pytest.approx(0.2, rel=0.05)
    assert e.weight_update_overhead_s == pytest.approx(0.02, rel=0.01)
    assert prof.sources["eff.mfu_train"].kind == "fitted" and prof.sources["gpu.peak_tflops"].kind == "measured"
    assert prof.gpu.host_cores == 0 and prof.sources["gpu.host_cores"].kind == "assumed"  # no rollout measurement


def test_cpu_fit_takes_request_and_rollout_costs_from_their_points() -> None:
    """With per-request points (server CPU over b 1-token requests) the request cost is their
    slope, even with one point slowed by load, and the prefill cost is fitted to what is left;
    with a rollout-side measurement the host's cores are shared and the client's cost is kept."""
    spec, decode, train, sync = _measured(1.5e-3)
    requests = [{"batch": b, "server_cpu_s": 4e-3 + b * 1.5e-3} for b in REQUEST_BATCHES]
    requests[-1]["server_cpu_s"] *= 5  # a burst of load
    prof = fit_profile("cpu", spec, DEVICE, decode, train, sync, SETTINGS, requests=requests,
                       rollout={"client_cpu_per_request_s": 2e-3})
    assert prof.eff.request_overhead_s == pytest.approx(1.5e-3, rel=1e-6)
    assert prof.eff.mfu_prefill == pytest.approx(0.2, rel=0.05)
    assert "concurrent 1-token requests" in prof.sources["eff.request_overhead_s"].ref
    assert prof.measurements["requests"] == requests
    assert prof.gpu.host_cores == 2 and prof.eff.client_request_cpu_s == 2e-3
    assert prof.sources["eff.client_request_cpu_s"].kind == "measured"


def test_nelder_mead_minimises_a_quadratic() -> None:
    x, f = nelder_mead(lambda v: float((v[0] - 1) ** 2 + 3 * (v[1] + 2) ** 2), [0.0, 0.0], iters=500)
    assert math.isclose(x[0], 1, abs_tol=1e-3) and math.isclose(x[1], -2, abs_tol=1e-3) and f < 1e-6


def test_plan_on_a_profile(tmp_path, capsys) -> None:
    """`realscale plan --profile` plans with the profile's device and efficiencies (a slower
    profile gives a longer estimated step than the built-in one)."""
    prof = builtin_profile("H100")
    slow = HardwareProfile("H100-slow", prof.gpu, dataclasses.replace(prof.eff, mfu_train=0.05, hbm_decode=0.1))
    path = tmp_path / "slow.json"
    slow.save(str(path))
    args = ["plan", "--model", "qwen2-1.5b", "--nodes", "1", "--gpus-per-node", "8", "--no-ref", "--json",
            "--gen-len", "4096", "--iters", "2000"]
    assert main(args) == 0
    fast = json.loads(capsys.readouterr().out)["estimate"]["step_seconds"]
    assert main(args + ["--profile", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["estimate"]["step_seconds"] > 2 * fast

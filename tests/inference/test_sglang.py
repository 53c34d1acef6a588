"""The real SGLang server (the pinned 0.5.23, unmodified, on CPU) as the rollout engine
(``generate.backend=sglang``), behind the same client the GPU recipes use.

Two servers started by the real launcher (``launcher.local.spawn_engine_server``: the
argv and environment of ``inference.sglang_launcher``), shared by the module: server A
with one rank, server B with ``--tp-size 2``. Both run with the prefix cache off (the
launcher's rule for retract / in_place pauses). The tests check what decoupled PPO needs
from the engine — behaviour log-probs equal to the Megatron trainer's on the same tokens
and weights, every token tagged with the weight version that sampled it, a weight update
in the middle of generation under each pause mode, updates from disk and from trainer
ranks (tp1, tp2, pp2) over SGLang's weight-update group on gloo, bit-identical weights
after it — then the faults (a server killed mid-run), ``realscale train`` and
``realscale eval`` with SGLang servers the launcher starts.

Needs SGLang-on-CPU: ``bash scripts/sglang_cpu/install.sh`` (a venv of its own, with
realscale in it); run from that venv: ``$VENV/bin/python -m pytest -m sglang``
(README, 'SGLang backend'). The SGLang source lines the behaviours rest on are cited at
each test; the fidelity of the embedded server to them is tests/inference/test_sglang_fidelity.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

import real_engines as cases
from realscale.parallel.spawn import run_distributed

pytestmark = [pytest.mark.sglang, pytest.mark.multiproc, pytest.mark.timeout(1500)]

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed here: bash scripts/sglang_cpu/install.sh, then run pytest from its venv",
                allow_module_level=True)

TOL = 1e-4  # fp32 on both sides; a wrong convention or stale weights differ by > 1e-2
# 400-token answers: SGLang's torch-native attention and Megatron's sum in other orders
# (8e-5 measured after a retract, 7.9e-4 once after an abort's recomputed prefix: a CI run
# of 2026-12-02), as vLLM's twin allows (test_vllm.py TOL_LONG: a max over hundreds of
# per-token gaps, 1.07e-3 once there); a stale KV is off by ~10
LONG_TOL = 3e-3
PROMPTS = [[10, 11, 12], list(range(40, 70)), [99, 100, 101, 102, 103]]


def _gen_config(**kw):
    from realscale.config import GenerateConfig

    base = dict(backend="sglang", max_running_requests=8, context_length=512, pause_mode="retract")
    return GenerateConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_models")
    return cases.tiny_model(str(root / "base"), 0), cases.tiny_model(str(root / "new"), 7)


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """[(url, ranks, ServerProc)]: A with one rank, B with two (--tp-size 2)."""
    gens = [_gen_config(tp=1), _gen_config(tp=2)]
    with cases.engine_servers(models[0], gens, str(tmp_path_factory.mktemp("sglang_logs")), "SGLang server", 900,
                              grace=15) as s:
        yield s


def _client(urls):
    from realscale.inference.client import InferenceClient

    return InferenceClient(urls, request_timeout=300)


async def _load(urls, model_dir, version):
    async with _client(urls) as c:
        await c.update_weights_from_disk(model_dir, weight_version=version)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_generation_logprobs_equal_megatron(servers, models, temperature) -> None:
    """Sampled tokens with per-token log-probs (``return_logprob``: SGLang's
    ``output_token_logprobs``, of the temperature-scaled distribution); they equal the
    Megatron engine's on the same tokens, on a one-rank and a two-rank server, and carry
    the version the server was loaded as (``meta_info.weight_version``)."""
    urls = [u for u, _, _ in servers]
    asyncio.run(_load(urls, models[0], 0))
    results, diff = cases.served_vs_megatron(_client, urls, models[0], PROMPTS, temperature)
    print(f"SGLang vs Megatron behaviour log-probs, T={temperature}: max |diff| = {diff:.2e}")
    for r in results:
        assert len(r.output_ids) == len(r.output_logprobs) == 24
        assert set(r.output_versions) == {0}
        assert all(lp < 0 for lp in r.output_logprobs)
    assert diff < TOL


async def _used_tokens(client, url):
    """Tokens the server holds in its KV pool now (``/v1/loads``: ``num_used_tokens``,
    sglang/srt/managers/scheduler_components/load_inquirer.py, ``get_loads``); with the
    prefix cache off, the running requests' prompts and outputs so far."""
    async with client.session.get(url + "/v1/loads", params={"include": "core"}) as resp:
        return sum(int(load["num_used_tokens"]) for load in (await resp.json())["loads"])


async def _update_mid_generation(url, pause_mode, new_dir, version, params, n):
    """Start ``n`` long generations, then pause / load ``new_dir`` as ``version`` / resume.
    Returns the results and whether a request ended before the pause had taken effect (it
    finished before the pause call returned: then it may rightly hold no new-version token)."""
    async with _client([url]) as c:
        tasks = [asyncio.create_task(c.generate(p, params)) for p in PROMPTS[:n]]
        ended = cases.end_times(tasks)
        prompt_tokens = sum(len(p) for p in PROMPTS[:n])
        for _ in range(1200):  # until the batch has decoded some tokens
            await asyncio.sleep(0.05)
            if await _used_tokens(c, url) >= prompt_tokens + n * 8 or len(ended) == n:
                break
        await c.pause(pause_mode)
        paused = time.monotonic()
        # under a pause that keeps requests SGLang refuses the cache flush (400) although it
        # applied the weights (weight_updater.py:120): the publisher asks for none then
        await c.update_weights_from_disk(new_dir, weight_version=version, flush_cache=pause_mode == "abort")
        await c.resume()
        results = await asyncio.gather(*tasks)
        return results, any(at <= paused for at in ended.values())


@pytest.mark.parametrize("pause_mode", ["abort", "retract", "in_place"])
def test_weight_update_mid_generation(servers, models, pause_mode) -> None:
    """A weight update from disk in the middle of long generations: every answer has
    tokens of both versions, in order (SGLang's ``weight_versions`` spans). abort: the
    request returns with its partial output and ``finish_reason.type == "abort"``
    (tokenizer_manager ``_handle_abort_finish_reason``) and the client resubmits it, so
    the new version's tokens are computed on a KV recomputed under the new weights (they
    equal a fresh Megatron pass on the new weights); retract: the scheduler retracts the
    running requests (``retract_all``) and recomputes their KV under the new weights,
    without the client seeing an interruption; in_place: the requests continue on the
    KV computed under the old weights, never interrupted (so their later tokens do not
    equal a fresh pass, and that is measured, not asserted)."""
    base, new = models
    url = servers[0][0]
    params = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}

    def attempt():
        asyncio.run(_load([url], base, 0))
        return asyncio.run(_update_mid_generation(url, pause_mode, new, 1, params, n=3))

    results = cases.mid_generation_tries(attempt, pause_mode)
    trained_new = cases.engine_lps(new, PROMPTS[:3], [r.output_ids for r in results], 1.0)
    trained_old = cases.engine_lps(base, PROMPTS[:3], [r.output_ids for r in results], 1.0)
    new_parts = []
    for r, t_new, t_old in zip(results, trained_new, trained_old):
        v = r.output_versions
        assert 1 in v, v
        cut = v.index(1)
        assert 0 < cut < len(v) == 400 and v == [0] * cut + [1] * (len(v) - cut), v
        assert cases.max_diff(r.output_logprobs[:cut], t_old[:cut]) < LONG_TOL  # old weights, old KV
        new_parts.append(cases.max_diff(r.output_logprobs[cut:], t_new[cut:]))
        assert (r.num_interruptions >= 1) if pause_mode == "abort" else (r.num_interruptions == 0)
        if pause_mode != "in_place":
            assert new_parts[-1] < LONG_TOL
    print(f"{pause_mode}: versions switch at tokens {[r.output_versions.index(1) for r in results]}; "
          f"after it max |diff| to a fresh pass on the new weights {max(new_parts):.2e}")


def _served_weights(url: str, names: list[str], rows: int) -> dict[str, list]:
    """The server's weights by HF name, first ``rows`` rows, gathered over its ranks
    (``/get_weights_by_name``; sglang/srt/models/llama.py ``get_weights_by_name``)."""
    import requests

    out = {}
    for name in names:
        reply = requests.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": rows}, timeout=120)
        reply.raise_for_status()
        out[name] = reply.json()
    return out


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "tp2pp2"])
def test_weight_update_over_gloo_from_trainer_layouts(servers, models, tmp_path, layout) -> None:
    """Trainer ranks (Megatron tp1, tp2, pp2 or tp2 x pp2) push new weights into both
    servers (1 + 2 ranks: a weight group of 4) with the run's transport — SGLang's
    weight-update group on gloo (``/init_weights_update_group`` with ``backend: "gloo"``, a
    ``/begin_weight_update`` … ``/end_weight_update`` session of
    ``/update_weights_from_distributed`` buckets; a pipelined trainer hosts one group per
    stage, ``-stage<s>``, and each stage's first rank broadcasts its own part: the real
    server holds several groups and takes their buckets in turn within one session) —
    twice (the groups are reused); then
    each server's log-probs equal the trainer's, its tokens carry the new version, and its
    weights are bit-identical to the checkpoint the trainer loaded."""
    import torch
    from dataclasses import asdict
    from safetensors.torch import load_file

    from realscale.config import Config

    base, new = models
    urls = [u for u, _, _ in servers]
    asyncio.run(_load(urls, base, 0))
    cfg = Config()
    cfg.generate = _gen_config()
    cfg.data.task_heldout = 20
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    world, pp = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (2, 2), "tp2pp2": (4, 2)}[layout]
    out = run_distributed(cases.publish_to_servers, world, asdict(cfg), base, new,
                          [(u, tp) for u, tp, _ in servers], str(tmp_path), [3, 4], PROMPTS[1], params, pp,
                          timeout=900)[0]
    for served, trained, versions in zip(out["served"], out["trained"], out["versions"]):
        assert set(versions) == {4}
        assert cases.max_diff(served, trained) < TOL
    stats = out["stats"][-1]
    assert stats["perf/weight_sync_bytes"] == stats["perf/weight_sync_bytes_lower_bound"] * 3 / 2  # 3 ranks, 2 servers
    want = load_file(os.path.join(new, "model.safetensors"))
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.norm.weight", "lm_head.weight"]
    for url in urls:
        for name, got in _served_weights(url, names, rows=1 << 16).items():
            assert _served_is(torch.tensor(got, dtype=torch.float32), want[name].float()), (url, name)


def _served_is(got, want) -> bool:
    """``got`` (from ``/get_weights_by_name``) holds exactly ``want``'s values: SGLang pads
    the vocabulary dimension with zero rows (``VocabParallelEmbedding``), and a tensor it
    does not gather over its ranks comes back as rank 0's shard, the leading block."""
    import torch

    if got.shape[0] > want.shape[0]:
        if got[want.shape[0]:].any():
            return False
        got = got[:want.shape[0]]
    return got.dim() == want.dim() and torch.equal(got, want[tuple(slice(0, n) for n in got.shape)])


def test_idle_connections_outlive_sglangs_keep_alive(servers, models) -> None:
    """The client's pooled connections sit idle for a whole training step between control
    calls; SGLang's uvicorn would close them after 5 s (``SGLANG_TIMEOUT_KEEP_ALIVE``,
    sglang/srt/environ.py:337). The launcher raises it; a call after 7 idle seconds goes
    out on the same pool and succeeds."""
    url, _, proc = servers[0]
    with open(f"/proc/{proc.proc.pid}/environ", "rb") as fh:
        env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
    assert env[b"SGLANG_TIMEOUT_KEEP_ALIVE"] == b"3600"

    async def go():
        async with _client([url]) as c:
            first = await c.generate(PROMPTS[0], {"max_new_tokens": 4})
            await asyncio.sleep(7.0)
            await c.pause("abort")
            await c.resume()
            return first, await c.generate(PROMPTS[0], {"max_new_tokens": 4}), [s.url for s in c.servers if s.retired]

    first, second, retired = asyncio.run(go())
    assert len(first.output_ids) == len(second.output_ids) == 4 and retired == []


def test_killed_server_run_continues(servers, models) -> None:
    """Server B is killed while requests are in flight: every request still completes (on
    A), and the next weight update retires B and reaches A. (Last of the module's server
    tests: B stays dead.)"""
    base, new = models
    urls = [u for u, _, _ in servers]
    asyncio.run(_load(urls, base, 0))
    victim = servers[1][2]
    results, after, retired = cases.kill_one_mid_generation(_client, urls, victim.proc.pid, new, PROMPTS)
    victim.proc.wait(timeout=60)
    assert all(len(r.output_ids) == 64 for r in results)
    assert retired == [urls[1]]
    assert set(after.output_versions) == {1}


def test_restarted_server_rejoins_the_weight_group(servers, models, tmp_path) -> None:
    """B is dead (the test before). The launcher's spawner starts a new SGLang server C
    on the base model, as the run's launcher restarts a dead one; a first publish retires
    B and hosts the weight group for A alone; the roster then names C, and the next
    publish rebuilds the group (A leaves it: ``/destroy_weights_update_group``, SGLang
    refuses a group name twice, ``init_custom_process_group``) with C in it, and puts C in
    the rotation. C's tokens carry the new version, its log-probs equal the trainer's, and
    its weights are the trainer's bit for bit."""
    from dataclasses import asdict

    import torch
    from safetensors.torch import load_file

    from realscale.config import Config

    base, new = models
    urls = [u for u, _, _ in servers]
    cfg = Config()
    cfg.generate = _gen_config()
    cfg.data.task_heldout = 20
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    names = ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
    with cases.engine_servers(base, [_gen_config()], str(tmp_path), "SGLang server", 900, grace=15) as started:
        restarted = started[0][0]
        out = run_distributed(cases.rejoin_restarted, 1, asdict(cfg), base, new, [(u, tp) for u, tp, _ in servers],
                              (restarted, 1), str(tmp_path), PROMPTS[1], params, timeout=900)[0]
        weights = _served_weights(restarted, names, rows=1 << 16)
    assert out["retired"] == [urls[1]] and out["rotation"] == sorted([urls[0], restarted])
    for served, trained, versions in zip(out["served"], out["trained"], out["versions"]):
        assert set(versions) == {2}
        assert cases.max_diff(served, trained) < TOL
    want = load_file(os.path.join(new, "model.safetensors"))
    for name, got in weights.items():
        assert _served_is(torch.tensor(got, dtype=torch.float32), want[name].float()), name


def _realscale(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "realscale", *args], capture_output=True, text=True, timeout=timeout)


def test_train_and_eval_with_sglang_servers(tmp_path) -> None:
    """``realscale train generate.backend=sglang`` on CPU: the local launcher starts a real
    SGLang server, the trainer publishes each step's weights into it over SGLang's weight
    group (gloo), the answers it trains on carry the versions that sampled them (staleness
    within the bound); then ``realscale eval`` of the run's checkpoint against SGLang
    servers it starts itself."""
    steps = 4
    run = tmp_path / "r"
    out = _realscale("train", "model.path=tiny-qwen2", "generate.backend=sglang", f"run.total_steps={steps}",
                     "run.checkpoint_every=4", "rollout.batch_size=8", "rollout.n_samples=4", "rollout.max_staleness=1",
                     "generate.max_new_tokens=16", "generate.max_running_requests=16", "generate.context_length=256",
                     "data.source=task:arith", "data.task_heldout=20", f"run.output_dir={tmp_path}", "run.name=r")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == list(range(1, steps + 1))
    assert all(m["perf/weight_sync_bytes"] > 0 for m in trained[1:])
    assert all(m.get("staleness/max", 0) <= 1 for m in metrics)
    log = (run / "logs" / "server0.log").read_text(errors="replace")
    assert "server_args={'model_path'" in log, log[-2000:]  # SGLang's start-up line: a real SGLang server ran
    assert (run / "final" / "config.json").exists()
    ev = _realscale("eval", "--model", str(run / "final"), "--data", "task:arith", "--num", "20", "--samples", "1",
                    "--k", "1", "--out", str(tmp_path / "eval"), "generate.backend=sglang", "data.task_heldout=20")
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    # one record per "\n": a random tiny model's completions may hold U+0085 or U+2028, which
    # per_problem.jsonl writes raw (ensure_ascii=False) and str.splitlines() would split on
    with open(tmp_path / "eval" / "per_problem.jsonl", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    assert len(rows) == 20 and all("correct" in r for r in rows)


def test_routed_experts_wire_format_is_sglangs_own() -> None:
    """Our encoder against the pinned SGLang's own decoder of ``meta_info["routed_experts"]``
    (``sglang/srt/state_capturer/routed_experts.py:166-173``: int32), and the reverse."""
    import numpy as np
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    from realscale.inference.dialect import decode_routed_experts, encode_routed_experts

    rows = np.random.default_rng(0).integers(0, 128, (9, 3, 8)).astype(np.int32)
    text = encode_routed_experts(rows)
    assert np.array_equal(extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": text}}),
                          rows.reshape(-1))
    assert np.array_equal(decode_routed_experts(text), rows.reshape(-1))

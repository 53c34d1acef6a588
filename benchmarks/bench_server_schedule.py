"""The embedded server's scheduling under a recipe's rollout load: what batched admission
and shared prefill rows save, side by side in one run.

    python benchmarks/bench_server_schedule.py [--reps 3] [--smollm2-requests 64]

A driver thread keeps a recipe's number of requests in flight (``rollout.max_concurrent``)
against an in-process :class:`realscale.serve.engine.Engine` (one torch thread, as a
server gets here), eight requests per prompt submitted together (a group), and submits a
new one each time one finishes, as the rollout controller does. Three schedules, same
requests and seed, alternating within each repeat:

- ``before``: a request is prefilled whenever a slot is free (``admit_batch = 1``), every
  request on its own prefill row (``share_prefill = False``): the engine before 2026-12-03;
- ``batched admission``: with the queue full, new requests wait for a quarter of the slots;
- ``+ shared prefill``: a group's copies of one prompt share one prefill row (the default).

Loads: the default recipe's (its warm start, arithmetic prompts, 32 slots, 64 in flight, 24
new tokens at T = 1) and the SmolLM2 recipe's (SmolLM2-135M-Instruct, 45-token prompts,
64 slots, 16 in flight, 24 new tokens at T = 0.6 / top-p 0.95). Reports server CPU seconds
per 100 generated tokens, tokens/s, prefill and decode calls; medians over ``--reps``.
Writes ``benchmarks/results/server_schedule.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import REPO, run_realscale  # noqa: E402 - benchmarks/ is not a package
from _stats import load_average  # noqa: E402

LOAD_BEFORE = load_average()
SCHEDULES = {"before": (False, False), "batched admission": (True, False), "+ shared prefill": (True, True)}


def _drive(server: Any, prompts: list[list[int]], n_requests: int, in_flight: int, params: dict[str, Any],
           batched: bool, shared: bool, seed: int) -> dict[str, float]:
    from realscale.serve.engine import ADMIT_FRACTION, Request, SamplingOptions

    engine = server.engine
    engine.admit_batch = max(1, engine.max_running // ADMIT_FRACTION) if batched else 1
    engine.share_prefill = shared
    engine.generator.manual_seed(seed)
    calls = {"prefill": 0, "decode": 0}
    prefill, decode = engine._prefill, engine._decode

    def counted(name: str, fn: Any) -> Any:
        def run(reqs: list[Any]) -> None:
            calls[name] += 1
            fn(reqs)
        return run

    engine._prefill, engine._decode = counted("prefill", prefill), counted("decode", decode)
    slots, done, tokens = threading.Semaphore(in_flight), threading.Semaphore(0), [0]

    def finished(fut: Any) -> None:
        tokens[0] += len(fut.result().output_ids)
        slots.release()
        done.release()

    wall, cpu = time.perf_counter(), time.process_time()
    try:
        for i in range(n_requests):
            slots.acquire()
            req = Request(rid=str(i), input_ids=prompts[(i // 8) % len(prompts)], params=SamplingOptions(**params))
            engine.submit(req).add_done_callback(finished)
        for _ in range(n_requests):
            done.acquire()
    finally:
        engine._prefill, engine._decode = prefill, decode
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens[0], "tok_s": tokens[0] / wall,
            "cpu_ms_per_100_tokens": 1e5 * cpu / tokens[0], **calls}


def _case(name: str, model: str, max_running: int, context: int, prompts_of: Any, n_requests: int, in_flight: int,
          params: dict[str, Any], reps: int) -> dict[str, Any]:
    from realscale.serve.server import EmbeddedServer

    server = EmbeddedServer(model, max_running=max_running, context_length=context)
    try:
        prompts = prompts_of(server.tokenizer)
        _drive(server, prompts, min(n_requests, 32), in_flight, params, True, True, 0)  # warm-up
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in SCHEDULES}
        for rep in range(reps):
            for label, (batched, shared) in SCHEDULES.items():
                runs[label].append(_drive(server, prompts, n_requests, in_flight, params, batched, shared, rep))
                print(name, label, rep, {k: round(v, 2) for k, v in runs[label][-1].items()}, flush=True)
    finally:
        server.close()
    med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    return {"model": model, "max_running": max_running, "in_flight": in_flight, "requests": n_requests,
            "params": params, "median": med, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny-requests", type=int, default=768)
    ap.add_argument("--smollm2-requests", type=int, default=64)
    ap.add_argument("--tiny-model", default=None, help="the default recipe's warm start (default: "
                    "runs/bench_vs_peers/sft or runs/bench_startup/sft, else a `realscale sft` made first)")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "server_schedule.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    tiny = args.tiny_model or next((p for p in (os.path.join(REPO, "runs", d, "sft") for d in (
        "bench_vs_peers", "bench_startup", "bench_server_schedule")) if os.path.isfile(os.path.join(p, "model.safetensors"))),
        None)
    if tiny is None:
        tiny = os.path.join(REPO, "runs", "bench_server_schedule", "sft")
        os.makedirs(os.path.dirname(tiny), exist_ok=True)
        run_realscale(["sft", os.path.join(REPO, "configs", "tiny_cpu.yaml"), f"sft.output={tiny}"],
                      os.path.dirname(tiny) + "/sft.log", "bench_server_schedule")
    rng = random.Random(0)
    cases = {"default recipe": _case(
        "default recipe", tiny, 32, 2048,
        lambda tok: [tok(f"{rng.randint(0, 29)}+{rng.randint(0, 29)}=")["input_ids"] for _ in range(64)],
        args.tiny_requests, 64, {"max_new_tokens": 24, "temperature": 1.0}, args.reps)}
    if not args.skip_smollm2:
        cases["smollm2 recipe"] = _case(
            "smollm2 recipe", "smollm2-135m", 64, 256,
            lambda tok: [[rng.randrange(100, 40000) for _ in range(45)] for _ in range(16)],
            args.smollm2_requests, 16, {"max_new_tokens": 24, "temperature": 0.6, "top_p": 0.95}, args.reps)
    for name, case in cases.items():
        base = case["median"]["before"]["cpu_ms_per_100_tokens"]
        print(f"\n{name}: server CPU ms per 100 tokens (median of {args.reps})")
        for label, m in case["median"].items():
            print(f"  {label:20s} {m['cpu_ms_per_100_tokens']:8.1f}  {base / m['cpu_ms_per_100_tokens']:.2f}x  "
                  f"{m['tok_s']:7.0f} tok/s  prefills {m['prefill']:.0f} decodes {m['decode']:.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"load_average_before": LOAD_BEFORE, "torch": torch.__version__, "machine": platform.processor(),
                   "date": time.strftime("%Y-%m-%d %H:%M"), "cases": cases}, fh, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()

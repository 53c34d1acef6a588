"""Tokens/s of one embedded generation server against the number of requests in flight.

    python benchmarks/bench_server_concurrency.py [--model runs/bench_async/sft] [--inflight 4 8 16 32 64 128]

Why: the async-vs-sync benchmark's gain depends on how much a full server beats one that a
synchronous step leaves half empty. This starts ``realscale serve`` (1 thread, 64 KV
slots, as ``configs/long_tail_cpu.yaml`` runs it), keeps K ``generate`` calls of the
long-tail task's prompts in flight for ``--seconds`` each (a finished call is replaced
at once), and reports generated tokens per second for each K. The default model is the
warm start ``benchmarks/bench_async.py`` leaves in ``runs/bench_async/sft``.
Writes ``benchmarks/results/server_concurrency.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(REPO, "benchmarks", "results", "server_concurrency.json")


async def _tokens_per_s(url: str, prompts: list[list[int]], inflight: int, seconds: float,
                        max_new_tokens: int) -> float:
    """Generated tokens/s with ``inflight`` calls kept running for ``seconds``."""
    from realscale.inference.client import InferenceClient

    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0}
    source = itertools.cycle(prompts)
    tokens = 0
    async with InferenceClient([url]) as client:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal tokens
            while time.perf_counter() < end:
                res = await client.generate(next(source), params)
                tokens += len(res.output_ids)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        return tokens / (time.perf_counter() - start)


def _prompts(model: str, data_cfg: object) -> list[list[int]]:
    from transformers import AutoTokenizer

    from realscale.data.tokens import prompt_ids
    from realscale.tasks.long_tail import LongTailTask

    tokenizer = AutoTokenizer.from_pretrained(model)
    task = LongTailTask.from_config(data_cfg)
    return [prompt_ids(tokenizer, p.prompt) for p in task.split("train")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(REPO, "runs", "bench_async", "sft"), help="HF model directory")
    ap.add_argument("--recipe", default=os.path.join(REPO, "configs", "long_tail_cpu.yaml"))
    ap.add_argument("--inflight", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring time per K")
    ap.add_argument("--out", default=RESULT)
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"bench_server_concurrency: no model at {args.model}; run benchmarks/bench_async.py "
                         "first (it leaves its warm start there) or pass --model")
    if any(k < 1 for k in args.inflight):
        raise SystemExit(f"bench_server_concurrency: --inflight values must be >= 1, got {args.inflight}")
    sys.path.insert(0, REPO)
    from realscale.config import load_config
    from realscale.launcher.local import start_servers, stop_servers

    cfg = load_config(args.recipe)
    prompts = _prompts(args.model, cfg.data)
    servers = start_servers(args.model, 1, os.path.join(REPO, "runs", "bench_server_concurrency"), threads=1,
                            max_running=cfg.generate.max_running_requests, context_length=cfg.generate.context_length)
    rates: dict[int, float] = {}
    try:
        for k in args.inflight:
            rates[k] = asyncio.run(_tokens_per_s(servers[0].url, prompts, k, args.seconds,
                                                 cfg.generate.max_new_tokens))
            print(f"{k:4d} in flight: {rates[k]:7.0f} tokens/s", flush=True)
    finally:
        stop_servers(servers)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"benchmark": "server_concurrency", "command": " ".join(["python", *sys.argv]),
                   "model": os.path.relpath(args.model, REPO), "kv_slots": cfg.generate.max_running_requests,
                   "seconds_each": args.seconds, "tokens_per_s": {str(k): v for k, v in rates.items()},
                   "load_avg_1_5_15": list(os.getloadavg())}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

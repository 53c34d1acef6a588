"""Generation throughput and pause latency: embedded server vs HF transformers, side by side.

    python benchmarks/bench_generate.py [--quick]

1. Equal batch (16 requests, ~4.6M-param Qwen2 ``small-qwen2``, 32-token prompts, 128
   new tokens each, no early stop): our engine (in-process, and end to end over HTTP)
   vs HF ``model.generate`` on the same batch, greedy and sampling.
2. Long-tailed outputs (lognormal lengths): continuous batching (our engine, 16 slots,
   all requests queued at once) vs static batching (HF ``generate`` on groups of 16,
   each group running until its longest member is done), useful tokens per second.
3. Pause latency: 16 running requests, ``/pause_generation`` (abort) -> every request
   answered, measured at the client.

Writes ``benchmarks/results/bench_generate.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _stats import Spread, load_average, spread  # noqa: E402 - benchmarks/ is not a package

MODEL = "small-qwen2"


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, sample: bool) -> float:
    """Seconds for HF generate on one equal-length batch, exactly ``new_tokens`` each."""
    ids = torch.tensor(prompts)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=None) if sample else dict(do_sample=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, **kw)
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return dt


def _engine_run(engine, prompts: list[list[int]], lengths: list[int], temperature: float) -> float:
    """Seconds for our engine to finish all requests submitted at once (continuous batching)."""
    from realscale.serve.engine import Request, SamplingOptions

    reqs = [Request(rid=str(i), input_ids=p, params=SamplingOptions(max_new_tokens=n, temperature=temperature,
                                                                      ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    t0 = time.perf_counter()
    futs = [engine.submit(r) for r in reqs]
    for f in futs:
        f.result()
    dt = time.perf_counter() - t0
    assert all(len(r.output_ids) == n for r, n in zip(reqs, lengths))
    return dt


async def _http_run(url: str, prompts: list[list[int]], new_tokens: int, temperature: float) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async def one(p: list[int]) -> int:
            async with s.post(url + "/generate", json={"input_ids": p, "return_logprob": True, "sampling_params": {
                    "max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True}}) as r:
                return len((await r.json())["output_ids"])
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t0
    assert all(c == new_tokens for c in counts)
    return dt


async def _pause_latency(url: str, prompts: list[list[int]]) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async def one(p: list[int]) -> float:
            async with s.post(url + "/generate", json={"input_ids": p, "sampling_params": {
                    "max_new_tokens": 1500, "ignore_eos": True}}) as r:
                await r.read()
                return time.perf_counter()
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        while True:
            async with s.get(url + "/get_server_info") as r:
                if (await r.json())["num_running_reqs"] == len(prompts):
                    break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        async with s.post(url + "/pause_generation", json={"mode": "abort"}) as r:
            await r.read()
        done = await asyncio.gather(*tasks)
        async with s.post(url + "/continue_generation", json={}) as r:
            await r.read()
    return max(done) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and requests (smoke run)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads for both sides")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per case")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from realscale.serve.server import EmbeddedServer, start_in_thread
    from realscale.models.tiny import resolve_model_path

    path = resolve_model_path(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    batch, prompt_len = 16, 32
    new_tokens = 32 if args.quick else 128
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 260, prompt_len).tolist() for _ in range(batch)]

    server = EmbeddedServer(path, max_running=batch, context_length=2048)
    url, stop = start_in_thread(server)
    engine = server.engine
    rows = []
    load_before = load_average()
    try:
        _engine_run(engine, prompts, [8] * batch, 1.0)  # warm-up
        _hf_generate(hf, prompts, 8, False)
        for name, temp, sample in [("greedy", 0.0, False), ("sampling", 1.0, True)]:
            tokens = batch * new_tokens
            # Interleaved repeats, so machine noise hits every side alike; medians compared.
            runs: dict[str, list[float]] = {"hf": [], "ours": [], "ours_http": []}
            for _ in range(args.repeats):
                runs["hf"].append(tokens / _hf_generate(hf, prompts, new_tokens, sample))
                runs["ours"].append(tokens / _engine_run(engine, prompts, [new_tokens] * batch, temp))
                runs["ours_http"].append(tokens / asyncio.run(_http_run(url, prompts, new_tokens, temp)))
            tok_s = {k: spread(v) for k, v in runs.items()}
            rows.append({"case": f"batch {batch}, {name}", "tok_s": {k: v.as_dict() for k, v in tok_s.items()},
                         "ratio": tok_s["ours"].median / tok_s["hf"].median,
                         "ratio_http": tok_s["ours_http"].median / tok_s["hf"].median})

        # Long tail: lognormal output lengths, identical for both sides.
        n_req = 32 if args.quick else 96
        lengths = np.clip(rng.lognormal(mean=np.log(40), sigma=1.0, size=n_req), 4, 1000).astype(int).tolist()
        tail_prompts = [rng.integers(4, 260, prompt_len).tolist() for _ in range(n_req)]
        useful = sum(lengths)
        t_static = 0.0
        for i in range(0, n_req, batch):
            group = tail_prompts[i:i + batch]
            t_static += _hf_generate(hf, group, max(lengths[i:i + batch]), True)
        t_cont = _engine_run(engine, tail_prompts, lengths, 1.0)
        t_ours_static = 0.0
        for i in range(0, n_req, batch):  # our engine, but waiting for each whole group: static batching
            t_ours_static += _engine_run(engine, tail_prompts[i:i + batch],
                                         [max(lengths[i:i + batch])] * len(lengths[i:i + batch]), 1.0)
        tail = {"requests": n_req, "useful_tokens": useful, "max_len": max(lengths),
                "median_len": int(statistics.median(lengths)),
                "continuous_tok_s": useful / t_cont, "hf_static_tok_s": useful / t_static,
                "ours_static_tok_s": useful / t_ours_static,
                "ratio_vs_hf_static": t_static / t_cont, "ratio_vs_ours_static": t_ours_static / t_cont}

        lat = [asyncio.run(_pause_latency(url, prompts)) for _ in range(3 if args.quick else 5)]
        pause = {"requests": batch, "median_ms": 1000 * statistics.median(lat), "max_ms": 1000 * max(lat)}
    finally:
        stop()

    load_after = load_average()
    print(f"\nmodel {MODEL}: {n_params / 1e6:.2f}M params, torch threads {args.threads}, "
          f"prompt {prompt_len}, new tokens {new_tokens}; {args.repeats} interleaved repeats; "
          f"load average {load_before:.2f} -> {load_after:.2f}")
    print("| case | HF generate tok/s median (IQR) | ours (engine) | ratio | ours (HTTP) | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        t = {k: Spread(**v).cell(1, 0) for k, v in r["tok_s"].items()}
        print(f"| {r['case']} | {t['hf']} | {t['ours']} | {r['ratio']:.2f}x | {t['ours_http']} | {r['ratio_http']:.2f}x |")
    print(f"\nlong tail: {tail['requests']} requests, lognormal lengths (median {tail['median_len']}, "
          f"max {tail['max_len']}), sampling, {batch} at a time")
    print(f"  continuous (ours)    {tail['continuous_tok_s']:>8.0f} useful tok/s")
    print(f"  static (HF generate) {tail['hf_static_tok_s']:>8.0f} useful tok/s   ratio {tail['ratio_vs_hf_static']:.2f}x")
    print(f"  static (our engine)  {tail['ours_static_tok_s']:>8.0f} useful tok/s   ratio "
          f"{tail['ratio_vs_ours_static']:.2f}x")
    print(f"\npause (abort) with {batch} running: median {pause['median_ms']:.1f} ms, max {pause['max_ms']:.1f} ms "
          f"until every request is answered")

    out = {"benchmark": "bench_generate", "model": MODEL, "params": n_params, "threads": args.threads,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
           "quick": args.quick, "load_average": [load_before, load_after], "equal_batch": rows, "long_tail": tail, "pause": pause}
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    dest = os.path.join(os.path.dirname(__file__), "results", "bench_generate.json")
    with open(dest, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
    print(f"\nwrote {dest}")


if __name__ == "__main__":
    main()

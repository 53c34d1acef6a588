"""The embedded server's forward pass: the tensor-parallel decoder at tp=1 vs the HF-module
runner it replaced, side by side under the same scheduler.

    python benchmarks/bench_runner.py [--threads 2] [--repeats 7]

The old runner (``realscale/generate/runner.py`` of commit 635c61d: the HF model's own
modules with our KV cache) is read from this repository's git history, so this needs a
git checkout. Both runners serve the same continuous-batching :class:`Engine`: 16
requests of 32 prompt tokens, 128 greedy tokens each (no early stop), ``small-qwen2``,
fp32; interleaved repeats, the median (with its spread) and the best of each reported. Also checks
that both produce the same tokens. Writes ``benchmarks/results/bench_runner.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _stats import load_average, spread  # noqa: E402 - benchmarks/ is not a package

OLD_COMMIT = "635c61d"
MODEL = "small-qwen2"


def _old_runner_class() -> type:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "-C", root, "show", f"{OLD_COMMIT}:realscale/generate/runner.py"],
                         capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="bench_runner_"), "old_runner.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location("old_runner", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.KVRunner


class _OldRanks:
    """The old runner behind the interface the engine uses today."""

    def __init__(self, runner_cls: type, model, slots: int, max_len: int) -> None:
        self.runner = runner_cls(model, slots, max_len)
        self.vocab_size = int(model.config.vocab_size)
        self.failure = None

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def forward(self, *args):
        return self.runner.forward(*args)

    def move_slot(self, *args) -> None:
        self.runner.move_slot(*args)


def _run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from realscale.serve.engine import Request, SamplingOptions

    reqs = [Request(rid=str(i), input_ids=p, params=SamplingOptions(max_new_tokens=new_tokens, temperature=0.0,
                                                                      ignore_eos=True)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for fut in [engine.submit(r) for r in reqs]:
        fut.result()
    return time.perf_counter() - t0, [r.output_ids for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from realscale.serve.engine import Engine
    from realscale.serve.ranks import ServerRanks
    from realscale.models.tiny import resolve_model_path

    path = resolve_model_path(MODEL)
    batch, prompt_len, new_tokens = 16, 32, 128
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 260, prompt_len).tolist() for _ in range(batch)]
    old = _OldRanks(_old_runner_class(), AutoModelForCausalLM.from_pretrained(path).eval(), batch, 2048)
    runners = {"HF-module runner (before)": old,
               "ShardedDecoder tp=1 (now)": ServerRanks(path, 1, max_slots=batch, max_len=2048)}
    engines = {k: Engine(r, None, max_running=batch, context_length=2048) for k, r in runners.items()}
    times: dict[str, list[float]] = {k: [] for k in engines}
    load_before = load_average()
    outs: dict[str, list[list[int]]] = {}
    try:
        for e in engines.values():
            _run(e, prompts, 8)  # warm-up
        for _ in range(args.repeats):
            for k, e in engines.items():
                dt, outs[k] = _run(e, prompts, new_tokens)
                times[k].append(dt)
    finally:
        for e in engines.values():
            e.shutdown()
    load_after = load_average()
    before, now = times
    # tokens/s of each repeat: the median and quartiles of a rate are those of its times, inverted
    tok_s = {k: spread([batch * new_tokens / t for t in v]) for k, v in times.items()}
    ratio = tok_s[now].median / tok_s[before].median
    same = outs[before] == outs[now]
    print(f"\nmodel {MODEL}, batch {batch}, prompt {prompt_len}, {new_tokens} greedy tokens each, "
          f"torch threads {args.threads}, {args.repeats} interleaved repeats, "
          f"load average {load_before:.2f} -> {load_after:.2f}")
    print("| runner | tok/s median (IQR) | best tok/s |")
    print("|---|---:|---:|")
    for k, v in tok_s.items():
        print(f"| {k} | {v.cell(1, 0)} | {v.hi:,.0f} |")
    print(f"ratio of medians now / before: {ratio:.2f}x   same tokens: {same}")
    out = {"benchmark": "bench_runner", "model": MODEL, "threads": args.threads, "batch": batch,
           "new_tokens": new_tokens, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "load_average": [load_before, load_after], "torch": torch.__version__,
           "tok_s": {k: v.as_dict() for k, v in tok_s.items()}, "ratio": ratio, "same_tokens": same}
    dest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_runner.json")
    with open(dest, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
    print(f"\nwrote {dest}")
    if not same:
        sys.exit("the two runners generated different tokens")


if __name__ == "__main__":
    main()

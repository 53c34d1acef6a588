"""The embedded server's forward pass: the tensor-parallel decoder at tp=1 vs the HF-module
runner it replaced, side by side under the same scheduler.

    python benchmarks/bench_runner.py [--threads 2] [--repeats 7]

The old runner (``realscale/generate/runner.py`` of commit 635c61d: the HF model's own
modules with our KV cache) is read from this repository's git history, so this needs a
git checkout. Both runners serve the same continuous-batching :class:`Engine`: 16
requests of 32 prompt tokens, 128 greedy tokens each (no early stop), ``small-qwen2``,
fp32; interleaved repeats, the best of each kept (the machine is shared). Also checks
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
    from realscale.generate.engine import Request, SamplingOptions

    reqs = [Request(rid=str(i), input_ids=p, params=SamplingOptions(max_new_tokens=new_tokens, temperature=0.0,
                                                                      ignore_eos=True)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for fut in [engine.submit(r) for r in reqs]:
        fut.result()
    return time.perf_counter() - t0, [r.output_ids for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats (best kept)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from realscale.generate.engine import Engine
    from realscale.generate.ranks import ServerRanks
    from realscale.models.tiny import resolve_model_path

    path = resolve_model_path(MODEL)
    batch, prompt_len, new_tokens = 16, 32, 128
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 260, prompt_len).tolist() for _ in range(batch)]
    old = _OldRanks(_old_runner_class(), AutoModelForCausalLM.from_pretrained(path).eval(), batch, 2048)
    runners = {"HF-module runner (before)": old,
               "ShardedDecoder tp=1 (now)": ServerRanks(path, 1, max_slots=batch, max_len=2048)}
    engines = {k: Engine(r, None, max_running=batch, context_length=2048) for k, r in runners.items()}
    best = {k: float("inf") for k in engines}
    outs: dict[str, list[list[int]]] = {}
    try:
        for e in engines.values():
            _run(e, prompts, 8)  # warm-up
        for _ in range(args.repeats):
            for k, e in engines.items():
                dt, outs[k] = _run(e, prompts, new_tokens)
                best[k] = min(best[k], dt)
    finally:
        for e in engines.values():
            e.shutdown()
    before, now = best
    tok_s = {k: batch * new_tokens / t for k, t in best.items()}
    same = outs[before] == outs[now]
    print(f"\nmodel {MODEL}, batch {batch}, prompt {prompt_len}, {new_tokens} greedy tokens each, "
          f"torch threads {args.threads}, best of {args.repeats} interleaved")
    for k, v in tok_s.items():
        print(f"  {k:<28}{v:>9.0f} tok/s")
    print(f"  ratio now / before: {tok_s[now] / tok_s[before]:.2f}x   same tokens: {same}")
    out = {"benchmark": "bench_runner", "model": MODEL, "threads": args.threads, "batch": batch,
           "new_tokens": new_tokens, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "load_avg": os.getloadavg(), "torch": torch.__version__, "tok_s": tok_s,
           "ratio": tok_s[now] / tok_s[before], "same_tokens": same}
    dest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_runner.json")
    with open(dest, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
    print(f"\nwrote {dest}")
    if not same:
        sys.exit("the two runners generated different tokens")


if __name__ == "__main__":
    main()

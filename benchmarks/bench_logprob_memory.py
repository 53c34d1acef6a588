"""Claim: computing per-token log-probs from the final hidden states in token chunks
(``realscale.train.logprobs.logprobs_from_hidden``) needs a fraction of the memory of the
straightforward full-logits path, with the same values and gradients.

Setting: one 8k-token packed sequence, Qwen's vocabulary (151,936), hidden size 896
(Qwen2-0.5B), fp32, temperature 0.7, forward + backward (gradients to the hidden states
and the output weight), one process (tp = 1).

* ours: ``logprobs_from_hidden(hidden, weight, targets, chunk_tokens=--chunk)``: logits
  exist only as one ``[chunk, V]`` block at a time, in forward and in backward.
* reference: ``logits = hidden @ weight.T`` then ``reference_logprobs`` (the generation
  server's ``token_logprobs``: ``log_softmax(logits.float() / T)`` gathered), through
  ordinary autograd, the way trainers usually do it.
* ``--with-logits-variant`` adds ours-from-logits (``vocab_parallel_logprobs`` on the
  materialised logits): the chunked softmax without the fused matmul.

Each variant runs in a fresh subprocess (so one's freed memory cannot hide another's
peak): it allocates the inputs, reads its resident size (the baseline: interpreter, torch,
inputs), runs forward + backward once, and reads ``ru_maxrss`` again; the table gives the
difference (the peak the computation added) and the wall time of that run. To protect a
shared machine, each child caps its address space (RLIMIT_AS) at what /proc/meminfo says
is available minus a margin; a variant that does not fit is reported, not retried.
The parent checks that the variants agree (log-probs, hidden grad, sampled weight rows).

    python benchmarks/bench_logprob_memory.py [--tokens 8192] [--vocab 151936] [--hidden 896]
        [--chunk 1024] [--threads 2] [--with-logits-variant]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "logprob_memory.json")
TEMPERATURE = 0.7
MARGIN_BYTES = 1536 << 20  # left to the rest of the machine when capping a child
GIB = float(1 << 30)


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmSize, VmRSS) in bytes."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _mem_available_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _make_inputs(n: int, vocab: int, hidden: int) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g).mul_(0.05)  # logits of a few units; in place: no transient copy
    return h.requires_grad_(), w.requires_grad_(), torch.randint(0, vocab, (n,), generator=g)


def _run_variant(name: str, h: Any, w: Any, targets: Any, vocab: int, chunk: int) -> Any:
    """Forward + backward of one variant; returns the log-probs (grads land on h and w)."""
    from realscale.train.logprobs import logprobs_from_hidden, reference_logprobs, vocab_parallel_logprobs

    if name == "ours":
        lp, _ = logprobs_from_hidden(h, w, targets, temperature=TEMPERATURE, vocab_start=0,
                                     true_vocab_size=vocab, chunk_tokens=chunk)
    elif name == "ours_from_logits":
        lp, _ = vocab_parallel_logprobs(h @ w.t(), targets, temperature=TEMPERATURE, vocab_start=0,
                                        true_vocab_size=vocab, chunk_tokens=chunk)
    elif name == "reference":
        lp, _ = reference_logprobs(h @ w.t(), targets, temperature=TEMPERATURE, true_vocab_size=vocab)
    else:
        raise ValueError(f"unknown variant {name!r}")
    lp.sum().backward()
    return lp.detach()


def child(args: argparse.Namespace) -> None:
    """One variant in this (fresh) process; prints one JSON line and saves outputs for the check."""
    import torch

    import realscale.train.logprobs  # noqa: F401 - imported before the clock starts

    torch.set_num_threads(args.threads)
    h, w, targets = _make_inputs(args.tokens, args.vocab, args.hidden)
    # The baseline is the *current* RSS, not ru_maxrss so far: a transient while building the
    # inputs would otherwise be subtracted from the computation's peak.
    base = _status_bytes("VmRSS")
    budget = args.budget_bytes
    resource.setrlimit(resource.RLIMIT_AS, (_status_bytes("VmSize") + budget, resource.RLIM_INFINITY))
    t0 = time.perf_counter()
    try:
        lp = _run_variant(args.child, h, w, targets, args.vocab, args.chunk)
    except (RuntimeError, MemoryError) as exc:  # the allocator refuses past RLIMIT_AS
        print(json.dumps({"variant": args.child, "error": str(exc).splitlines()[0][:200], "budget_bytes": budget}))
        return
    seconds = time.perf_counter() - t0
    peak = _maxrss_bytes()
    torch.save({"lp": lp, "grad_hidden": h.grad, "grad_w_rows": w.grad[::97].clone()}, args.out)
    print(json.dumps({"variant": args.child, "baseline_bytes": base, "peak_bytes": peak,
                      "added_peak_bytes": peak - base, "seconds": seconds, "budget_bytes": budget}))


def _spawn(variant: str, args: argparse.Namespace, out: str) -> dict[str, Any]:
    budget = max(0, _mem_available_bytes() - MARGIN_BYTES)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--out", out,
           "--budget-bytes", str(budget), "--tokens", str(args.tokens), "--vocab", str(args.vocab),
           "--hidden", str(args.hidden), "--chunk", str(args.chunk), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"variant {variant} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _max_diff(a: Any, b: Any) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--with-logits-variant", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    import torch

    variants = ["ours"] + (["ours_from_logits"] if args.with_logits_variant else []) + ["reference"]
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            path = os.path.join(tmp, f"{v}.pt")
            results[v] = _spawn(v, args, path)
            if "error" not in results[v]:
                outputs[v] = torch.load(path)
    ok = [v for v in variants if v in outputs]
    checks: dict[str, dict[str, float]] = {}
    if "reference" in outputs:
        ref = outputs["reference"]
        for v in ok:
            if v != "reference":
                checks[v] = {k: _max_diff(outputs[v][k], ref[k]) for k in ("lp", "grad_hidden", "grad_w_rows")}
    logits_gib = args.tokens * args.vocab * 4 / GIB
    print(f"{args.tokens:,} tokens x vocab {args.vocab:,}, hidden {args.hidden}, fp32, T={TEMPERATURE}, "
          f"chunk {args.chunk}, {args.threads} threads, torch {torch.__version__}; "
          f"one fp32 [T, V] tensor = {logits_gib:.2f} GiB")
    print("forward + backward (grads to hidden and weight), each variant in a fresh process; "
          "peak = max RSS minus the RSS after allocating inputs\n")
    print("| variant | added peak RSS (GiB) | vs reference | fwd+bwd s | vs reference |")
    print("|---|---:|---:|---:|---:|")
    ref_r = results["reference"]
    for v in variants:
        r = results[v]
        if "error" in r:
            print(f"| {v} | did not fit in {r['budget_bytes'] / GIB:.1f} GiB | - | - | - |")
            continue
        mem_ratio = ("-" if "error" in ref_r else "1.00x" if v == "reference"
                     else f"{ref_r['added_peak_bytes'] / r['added_peak_bytes']:.1f}x less")
        time_ratio = f"{ref_r['seconds'] / r['seconds']:.2f}x" if "error" not in ref_r else "-"
        print(f"| {v} | {r['added_peak_bytes'] / GIB:.2f} | {mem_ratio} | {r['seconds']:.1f} | {time_ratio} |")
    for v, c in checks.items():
        print(f"\n{v} vs reference: max |diff| log-probs {c['lp']:.2e}, hidden grad {c['grad_hidden']:.2e}, "
              f"weight grad (every 97th row) {c['grad_w_rows']:.2e}")
        if max(c.values()) > 1e-3:
            raise SystemExit(f"{v} disagrees with the reference: {c}")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump({"benchmark": "logprob_memory", "machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                   "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "chunk": args.chunk,
                   "temperature": TEMPERATURE, "dtype": "float32", "results": results, "max_abs_diff": checks},
                  fh, indent=1)
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()

"""Packed vs padded training throughput on a long-tailed length distribution.

Same sequences, same model, same engine (one gloo rank, megatron-core on CPU), one run:

- **packed**: our path — sequences packed back to back into balanced micro-batches
  under a token budget (``realscale.data.packing``), no padding.
- **padded**: what a padded 2-D dataloader does — fixed groups of ``--batch`` sequences in
  data order, each padded to the longest sequence of its group (pad tokens masked out of
  the loss but computed, as in a ``[B, T_max]`` batch; each padded row is run as its own
  micro-batch, which costs the same FLOPs as the ``[B, T_max]`` forward).

On CPU the local attention computes a packed row's full ``T x T`` scores (the
block-diagonal mask hides, but does not skip, cross-sequence pairs), so the packed side
pays some attention it does not need: the ratio understates what THD attention kernels
(GPU, Transformer Engine) give.

Throughput = real (non-pad) tokens trained per second. Writes
``benchmarks/results/packed_vs_padded.json``.

    python benchmarks/bench_packed_vs_padded.py [--seqs 96] [--model small-qwen2]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def lognormal_lengths(n: int, median: int, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=gen) * sigma) * median
    return [int(v) for v in x.clamp(lo, hi).round().tolist()]


def _batch(seqs: list[torch.Tensor], real: list[int]) -> object:
    from realscale.train.batch import PackedBatch

    masks = [torch.cat([torch.zeros(1), torch.ones(r - 1), torch.zeros(len(s) - r)]) for s, r in zip(seqs, real)]
    return PackedBatch.from_sequences(seqs, {"loss_mask": masks})


def nll(logp: torch.Tensor, mb: object, normalizer: torch.Tensor) -> tuple[torch.Tensor, dict]:
    mask = mb.fields["loss_mask"]  # type: ignore[attr-defined]
    return -(logp * mask).sum() / normalizer, {}


def worker(model: str, lengths: list[int], batch: int, budget: int, reps: int) -> dict:
    from realscale.models.tiny import resolve_model_path
    from realscale.train.engine import EngineConfig, MegatronEngine

    path = resolve_model_path(model)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 250, (n,), generator=gen) for n in lengths]
    eng = MegatronEngine(EngineConfig(model_path=path, lr=1e-5, max_tokens_per_micro_batch=budget))
    packed = _batch(seqs, lengths)
    padded_groups = []
    for i in range(0, len(seqs), batch):
        group = seqs[i:i + batch]
        width = max(len(s) for s in group)
        padded = [torch.cat([s, torch.zeros(width - len(s), dtype=torch.long)]) for s in group]
        padded_groups.append(_batch(padded, [len(s) for s in group]))
    real_tokens = sum(lengths)
    padded_tokens = sum(g.num_tokens for g in padded_groups)
    eng.train_step(packed, nll)  # warm-up (allocator, first-call costs)
    out = {"packed": [], "padded": []}
    for _ in range(reps):
        t = time.perf_counter()
        s = eng.train_step(packed, nll)
        out["packed"].append(time.perf_counter() - t)
        packed_mbs = s["micro_batches"]
        t = time.perf_counter()
        for g in padded_groups:
            # one padded [B, T_max] batch per step of the padded dataloader. Each padded row
            # runs as its own micro-batch (budget = T_max): the same FLOPs as one [B, T_max]
            # forward (B * T_max^2 attention), never attention across rows.
            eng.ec.max_tokens_per_micro_batch = int(g.seqlens().max())
            eng.train_step(g, nll)
        eng.ec.max_tokens_per_micro_batch = budget
        out["padded"].append(time.perf_counter() - t)
    return {"real_tokens": real_tokens, "padded_tokens": padded_tokens, "packed_micro_batches": packed_mbs,
            "padded_batches": len(padded_groups), "packed_s": min(out["packed"]), "padded_s": min(out["padded"]),
            "packed_all": out["packed"], "padded_all": out["padded"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-qwen2")
    ap.add_argument("--seqs", type=int, default=96)
    ap.add_argument("--median", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--batch", type=int, default=8, help="sequences per padded batch")
    ap.add_argument("--budget", type=int, default=1024, help="token budget of a packed micro-batch")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    from realscale.parallel.spawn import run_distributed

    lengths = lognormal_lengths(args.seqs, args.median, 1.0, 8, args.max_len, seed=1)
    r = run_distributed(worker, 1, args.model, lengths, args.batch, args.budget, args.reps, timeout=3000)[0]
    packed_tps = r["real_tokens"] / r["packed_s"]
    padded_tps = r["real_tokens"] / r["padded_s"]
    rows = [("packed (ours)", r["packed_micro_batches"], r["real_tokens"], r["packed_s"], packed_tps),
            ("padded [B, T_max]", r["padded_batches"], r["padded_tokens"], r["padded_s"], padded_tps)]
    print(f"{args.seqs} sequences, lognormal median {args.median}, max {max(lengths)}; real tokens {r['real_tokens']}")
    print(f"{'layout':<20} {'batches':>8} {'computed tok':>13} {'s/epoch':>9} {'real tok/s':>11}")
    for name, nb, comp, sec, tps in rows:
        print(f"{name:<20} {nb:>8} {comp:>13} {sec:>9.2f} {tps:>11.1f}")
    print(f"packed / padded throughput: {packed_tps / padded_tps:.2f}x")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "packed_vs_padded.json"), "w") as fh:
        json.dump({"args": vars(args), "lengths": lengths, **r, "ratio": packed_tps / padded_tps}, fh, indent=1)


if __name__ == "__main__":
    main()

"""Rollout batch to the trainer ranks: the pickled broadcast (main until the batch scatter)
vs the batch scatter (:mod:`realscale.train.batch_scatter`), side by side.

For each batch size and layout, each method runs in fresh gloo processes (so rank 0's
peak memory is its own):

- **broadcast**: rank 0 pickles the whole packed batch and ``broadcast_object_list`` sends
  it to every rank; each rank then takes its token-balanced share of each of the 4
  mini-batches (``share_for_rank``), as ``update_policy`` did;
- **scatter**: rank 0 splits the mini-batches into DP shares once (``split_for_dp``) and the
  scatter sends each rank the parts its stage reads of its share.

Reported: tensor bytes delivered to the ranks (broadcast: the pickle times the receivers;
scatter: what the receivers counted) against the lower bound (each rank's needs once),
seconds from a barrier until the slowest rank holds its shares (median of ``--repeats``),
and rank 0's memory: RSS once the batch exists, and its peak (``ru_maxrss``) after the
transfers.

Batches are synthetic (random tokens; the actor's fields: loss mask, behaviour log-probs,
advantages, versions): ``tiny`` is the default recipe's step (32 prompts x 8 answers, up
to ~40 tokens); ``mid`` 128 x 16, lognormal lengths up to 8k; ``areal`` the AReaL
recipes' step, 512 prompts x 16 answers, lognormal lengths (median 8k) up to 27,648
tokens (~2 GB), scaled down by ``--areal-scale`` (lengths multiplied; default 0.25:
~0.5 GB) because the broadcast's copies of a full-size batch on 4 ranks would take most
of this shared 24 GiB machine.

    python benchmarks/bench_batch_transfer.py              # writes results/bench_batch_transfer.json

The results file's ``data_path_model`` is the run simulator's data-path term (one per
method): ``seconds = fixed_s + s_per_byte * bytes`` fitted over the rows, ``bytes`` being
the tensor bytes delivered to trainer ranks (the trainer's ``perf/batch_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MINI_BATCHES = 4
MB = 1 << 20


def make_batch(size: str, areal_scale: float, seed: int = 0) -> Any:
    """The synthetic packed batch of ``size`` (module docstring), built without copies."""
    import torch

    from realscale.train.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    if size == "tiny":
        lens = torch.randint(10, 41, (32 * 8,), generator=g)
    elif size == "mid":
        lens = torch.exp(torch.randn(128 * 16, generator=g) * 0.8 + 7.0).clamp(16, 8192)
    else:
        lens = (torch.exp(torch.randn(512 * 16, generator=g) * 0.8 + 9.0).clamp(64, 27648) * areal_scale).clamp(min=16)
    lens = lens.long()
    cu = torch.zeros(lens.numel() + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lens, 0)
    n = int(cu[-1])
    fields = {"loss_mask": torch.ones(n), "behav_logprobs": -torch.rand(n, generator=g),
              "advantages": torch.randn(lens.numel(), generator=g).repeat_interleave(lens),
              "versions": torch.full((n,), 3.0)}
    return PackedBatch(torch.randint(0, 151_000, (n,), generator=g), cu, fields)


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _broadcast(batch: Any, r: Any) -> list[Any]:
    from realscale.train.actor import broadcast_batch, mini_batches, share_for_rank

    whole = broadcast_batch(batch)
    return [share_for_rank(p, r.dp, r.dp_rank) for p in mini_batches(whole, MINI_BATCHES)]


def _rank(method: str, size: str, tp: int, pp: int, repeats: int, areal_scale: float) -> dict[str, Any]:
    import pickle
    import resource

    import torch
    import torch.distributed as dist

    from realscale.config import AlgoConfig
    from realscale.train.batch_scatter import BatchScatter
    from realscale.parallel.megatron_state import Layout, init_megatron, rank_info
    from realscale.train.actor import split_for_dp, stage_needs

    init_megatron(Layout(tp=tp, pp=pp))
    r = rank_info()
    driver = dist.get_rank() == 0
    batch = make_batch(size, areal_scale) if driver else None
    scatter = BatchScatter(r, stage_needs(AlgoConfig()))
    rss_batch = _rss_mb()
    times, moved = [], 0
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if method == "scatter":
            shares, stats = scatter.scatter(split_for_dp(batch, MINI_BATCHES, r.dp) if driver else None)
            moved = stats.bytes
        else:
            shares = _broadcast(batch, r)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
        del shares
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    total = torch.tensor([moved], dtype=torch.float64)
    dist.all_reduce(total)
    out = {"seconds": statistics.median(times), "times": times, "bytes": int(total), "rss_batch_mb": rss_batch,
           "peak_rss_mb": peak}
    if driver:
        if method == "broadcast":  # the pickle goes to every other rank
            out["bytes"] = len(pickle.dumps(batch.to_payload())) * (dist.get_world_size() - 1)
        out.update(bound=scatter.lower_bound(split_for_dp(batch, MINI_BATCHES, r.dp)), tokens=batch.num_tokens,
                   batch_bytes=sum(t.nbytes for t in batch.to_payload().values()))
    return out


def measure(method: str, size: str, world: int, tp: int, pp: int, repeats: int, areal_scale: float) -> dict[str, Any]:
    from realscale.parallel.spawn import run_distributed

    res = run_distributed(_rank, world, method, size, tp, pp, repeats, areal_scale, timeout=1800)[0]
    dp = world // (tp * pp)
    return {"method": method, "size": size, "world": world, "layout": f"dp{dp}" + (f"xtp{tp}" if tp > 1 else "")
            + (f"xpp{pp}" if pp > 1 else ""), **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,mid,areal")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--areal-scale", type=float, default=0.25, help="multiplies the areal batch's lengths")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_batch_transfer.json"))
    args = ap.parse_args()
    uptime_start = os.popen("uptime").read().strip()
    layouts = [(2, 1, 1), (4, 1, 1), (4, 1, 2)]  # (world, tp, pp): dp2, dp4, dp2 x pp2
    rows = []
    for size in args.sizes.split(","):
        for world, tp, pp in layouts:
            pair = [measure(m, size, world, tp, pp, args.repeats, args.areal_scale) for m in ("broadcast", "scatter")]
            rows += pair
            b, s = pair
            print(f"{size:6s} {b['layout']:9s} {b['batch_bytes'] / MB:9.2f} MB batch | bytes moved: broadcast "
                  f"{b['bytes'] / MB:9.1f} MB, scatter {s['bytes'] / MB:9.1f} MB (bound {s['bound'] / MB:9.1f}) "
                  f"{b['bytes'] / max(s['bytes'], 1):5.2f}x | seconds: {b['seconds']:7.3f} vs {s['seconds']:7.3f} "
                  f"{b['seconds'] / max(s['seconds'], 1e-9):5.2f}x | rank-0 peak RSS over the batch: "
                  f"{b['peak_rss_mb'] - b['rss_batch_mb']:7.0f} vs {s['peak_rss_mb'] - s['rss_batch_mb']:7.0f} MB",
                  flush=True)
    model = {m: data_path_fit([r for r in rows if r["method"] == m]) for m in ("broadcast", "scatter")}
    for m, fit in model.items():
        print(f"data path ({m}): seconds = {fit['fixed_s']:.4f} + bytes x {fit['s_per_byte']:.3e} "
              f"({1 / fit['s_per_byte'] / MB:.0f} MB/s)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"areal_scale": args.areal_scale, "mini_batches": MINI_BATCHES, "repeats": args.repeats,
                   "uptime_start": uptime_start, "uptime": os.popen("uptime").read().strip(),
                   "data_path_model": model, "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")


def data_path_fit(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run simulator's data-path term, measured: least squares of a row's seconds (from a
    barrier until the slowest rank holds its shares) against the tensor bytes it delivered
    to the trainer ranks (sum over receiving ranks: the trainer's ``perf/batch_bytes``)."""
    xs, ys = [float(r["bytes"]) for r in rows], [r["seconds"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"s_per_byte": slope, "fixed_s": my - slope * mx, "rows": len(rows),
            "meaning": "seconds per step to deliver the batch = fixed_s + s_per_byte * bytes, bytes = tensor "
                       "bytes delivered to trainer ranks (perf/batch_bytes); gloo over loopback on this CPU "
                       "machine, 2 and 4 ranks (NCCL not measured)"}


if __name__ == "__main__":
    main()

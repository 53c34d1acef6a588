"""Time of one RL policy update (proximal log-probs + 4 PPO mini-batch steps) of the
default recipe's shape, against the packed micro-batch token budget, for two attention
implementations on the local (CPU) layer spec, side by side in one run:

* ``packed``: :class:`realscale.models.attention.PackedSDPAttention`, what the engine
  uses: attention within each packed sequence (SDPA over length groups).
* ``dense``: what the engine did before, megatron's own ``DotProductAttention`` over the
  whole packed row with a dense block-causal ``[T, T]`` mask (rebuilt here, below), whose
  cost grows with the square of the budget.

Same model, same batch, one process, one run; writes
``benchmarks/results/rl_update_budget.json``.

    python benchmarks/bench_rl_update.py [--budgets 512 2048 4096] [--reps 3]

With ``--proximal RECIPE``, the recipe's update (its model, mini-batches and token budget;
the batch shape from ``--seqs/--prompt/--response``) two ways, alternating, in one process:
``shortcut``, what :func:`realscale.train.actor.update_policy` does (the first
mini-batch's proximal log-probs from its own training forward), and ``own_forward``, what
it did before (a forward pass for them first, every other step the same). Writes
``benchmarks/results/rl_update_proximal_<recipe>.json``.

    python benchmarks/bench_rl_update.py --proximal configs/smollm2_chain_sum_cpu.yaml --seqs 32 --prompt 45 --response 22

With ``--shared RECIPE``, the recipe's update on GRPO-shaped batches (``--seqs`` /
``--samples`` prompts of ``--prompt`` tokens, each with ``--samples`` answers of 60-140% of
``--response`` tokens) three ways, alternating, in one process: ``unshared``
(``train.share_prefixes=false``: every sequence's prompt run again, mini-batches of every
``mini_batches``-th sequence as before), ``shared`` (each micro-batch's common prefixes run
once, the same mini-batches: a group's samples spread over them) and
``shared_whole_groups`` (``train.whole_groups``: each mini-batch holds whole groups). Writes
``benchmarks/results/rl_update_shared_<recipe>.json``.

    python benchmarks/bench_rl_update.py --shared configs/tiny_cpu.yaml --reps 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any

import torch

from realscale.parallel.spawn import run_distributed

LOAD_BEFORE = os.getloadavg()
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rl_update_budget.json")


def _batch(seqs: int, prompt: int, response: int) -> object:
    from realscale.train.batch import PackedBatch

    g = torch.Generator().manual_seed(0)
    n = prompt + response
    mask = [torch.tensor([0.0] * prompt + [1.0] * response) for _ in range(seqs)]
    return PackedBatch.from_sequences(
        [torch.randint(0, 250, (n,), generator=g) for _ in range(seqs)],
        {"loss_mask": mask, "behav_logprobs": [torch.full((n,), -1.0) for _ in range(seqs)],
         "advantages": [torch.randn(n, generator=g) for _ in range(seqs)], "versions": [m.clone() for m in mask]})


def _grouped_batch(prompts: int, samples: int, prompt: int, response: int) -> object:
    """``prompts`` x ``samples`` sequences (a prompt each, answers of random lengths) in
    group order, as ``realscale.train.actor.groups_to_batch`` packs them."""
    from realscale.train.batch import PackedBatch

    g = torch.Generator().manual_seed(0)
    seqs, masks = [], []
    for _ in range(prompts):
        head = torch.randint(0, 250, (prompt,), generator=g)
        for _ in range(samples):
            n = int(torch.randint(max(1, int(0.6 * response)), int(1.4 * response) + 1, (), generator=g))
            seqs.append(torch.cat([head, torch.randint(0, 250, (n,), generator=g)]))
            masks.append(torch.tensor([0.0] * prompt + [1.0] * n))
    return PackedBatch.from_sequences(seqs, {
        "loss_mask": masks, "behav_logprobs": [torch.full((len(s),), -1.0) for s in seqs],
        "advantages": [torch.full((len(s),), float(torch.randn((), generator=g))) for s in seqs],
        "versions": [m.clone() for m in masks]})


def _shared_rank(recipe: str, model_dir: str, reps: int, seqs: int, samples: int, prompt: int, response: int,
                 threads: int) -> dict[str, Any]:
    from realscale.config import load_config
    from realscale.train.actor import split_for_dp, update_policy
    from realscale.train.engine import EngineConfig, MegatronEngine

    torch.set_num_threads(threads)
    cfg = load_config(recipe, [])
    m = cfg.train.mini_batches
    ec = EngineConfig.from_config(cfg, model_dir)
    engines = {True: MegatronEngine(ec)}  # the second engine shares the first's megatron groups
    engines[False] = MegatronEngine(dataclasses.replace(ec, share_prefixes=False), shared_layout=True)
    batch = _grouped_batch(seqs // samples, samples, prompt, response)
    ways = {"unshared": (False, False), "shared": (True, False), "shared_whole_groups": (True, True)}
    out: dict[str, Any] = {way: [] for way in ways}
    rows: dict[str, float] = {}
    for rep in range(reps + 1):  # the first round warms up
        for way, (share, whole) in ways.items():
            shares = split_for_dp(batch, m, 1, whole_groups=whole)[0]
            t = time.perf_counter()
            stats = update_policy(engines[share], shares, cfg)
            if rep:
                out[way].append(time.perf_counter() - t)
            rows[way] = stats["train/row_fraction"]  # the last mini-batch's
    return {"seconds_per_update": out, "row_fraction": rows, "tokens": batch.num_tokens}


def shared(args: argparse.Namespace) -> None:
    from realscale.config import load_config
    from realscale.models.tiny import resolve_model_path

    path = load_config(args.shared, []).model.path
    model_dir = _tiny_model() if path == "sft" else resolve_model_path(path)
    res = run_distributed(_shared_rank, 1, args.shared, model_dir, args.reps, args.seqs, args.samples, args.prompt,
                          args.response, args.threads, timeout=3600)[0]
    med = {k: statistics.median(v) for k, v in res["seconds_per_update"].items()}
    print(f"{args.shared}: {args.threads} thread(s), {args.seqs // args.samples} prompts of {args.prompt} tokens x "
          f"{args.samples} answers of ~{args.response}, {res['tokens']} tokens; median of {args.reps} (load before "
          f"{LOAD_BEFORE[0]:.2f}):")
    for way, t in med.items():
        print(f"  {way:15s} {t:6.3f} s per update ({med['unshared'] / t:.2f}x unshared), rows run / tokens "
              f"{res['row_fraction'][way]:.2f}")
    name = os.path.splitext(os.path.basename(args.shared))[0]
    out = os.path.join(os.path.dirname(RESULTS), f"rl_update_shared_{name}.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({**res, "median": med, "args": vars(args), "model": model_dir,
                   "load_average_before": LOAD_BEFORE}, fh, indent=1)


def _dense_attention() -> type:
    """The engine's attention before PackedSDPAttention: megatron's ``DotProductAttention``
    over the whole packed row, masked block-causally (True = masked out)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from realscale.algo.packed import seq_ids

    class DenseMaskAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            seq = seq_ids(packed_seq_params.cu_seqlens_q.long(), query.shape[0])
            mask = ~((seq[:, None] == seq[None, :]) & torch.ones(len(seq), len(seq), dtype=torch.bool).tril())
            out = super().forward(query[:, None], key[:, None], value[:, None], mask[None, None], attn_mask_type)
            return out[:, 0]

    return DenseMaskAttention


def _rank(model_dir: str, budgets: list[int], reps: int, seqs: int, prompt: int,
          response: int) -> dict[str, dict[int, float]]:
    import realscale.models.attention as attention
    from realscale.config import load_config
    from realscale.train.actor import split_for_dp, update_policy
    from realscale.train.engine import EngineConfig, MegatronEngine

    batch = _batch(seqs, prompt, response)
    packed = attention.PackedSDPAttention
    out: dict[str, dict[int, float]] = {"packed": {}, "dense": {}}
    for budget in budgets:
        for impl in out:
            attention.PackedSDPAttention = packed if impl == "packed" else _dense_attention()  # read by layer_spec
            try:
                cfg = load_config("configs/tiny_cpu.yaml", [f"train.max_tokens_per_micro_batch={budget}"])
                eng = MegatronEngine(EngineConfig(model_path=model_dir, lr=1e-5, max_tokens_per_micro_batch=budget))
            finally:
                attention.PackedSDPAttention = packed
            update_policy(eng, split_for_dp(batch, cfg.train.mini_batches, 1)[0], cfg)  # warm-up
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                update_policy(eng, split_for_dp(batch, cfg.train.mini_batches, 1)[0], cfg)
                times.append(time.perf_counter() - t)
            out[impl][budget] = min(times)
    return out


def _proximal_rank(recipe: str, model_dir: str, reps: int, seqs: int, prompt: int, response: int,
                   threads: int) -> dict[str, list[float]]:
    from realscale.config import load_config
    from realscale.train.actor import split_for_dp, update_policy
    from realscale.train.engine import EngineConfig, MegatronEngine

    torch.set_num_threads(threads)
    cfg = load_config(recipe, [])
    eng = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
    batch = _batch(seqs, prompt, response)
    out: dict[str, list[float]] = {"shortcut": [], "own_forward": []}
    for rep in range(reps + 1):  # the first round warms up
        for way in out:
            shares = split_for_dp(batch, cfg.train.mini_batches, 1)[0]
            t = time.perf_counter()
            if way == "own_forward":  # present, the loss reads it: the update as it ran before
                shares[0].fields["prox_logprobs"] = eng.logprobs(shares[0])["logprobs"]
            update_policy(eng, shares, cfg)
            if rep:
                out[way].append(time.perf_counter() - t)
    return out


def proximal(args: argparse.Namespace) -> None:
    from realscale.config import load_config
    from realscale.models.tiny import resolve_model_path

    path = load_config(args.proximal, []).model.path
    model_dir = _tiny_model() if path == "sft" else resolve_model_path(path)  # sft: the recipe's warm start's shape
    times = run_distributed(_proximal_rank, 1, args.proximal, model_dir, args.reps, args.seqs, args.prompt,
                            args.response, args.threads, timeout=3600)[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.proximal}: {args.threads} thread(s), {args.seqs} sequences of {args.prompt} + {args.response} tokens, median of {args.reps}: "
          f"shortcut {med['shortcut']:.2f} s, own forward {med['own_forward']:.2f} s per update "
          f"({med['own_forward'] / med['shortcut']:.2f}x)")
    name = os.path.splitext(os.path.basename(args.proximal))[0]
    out = os.path.join(os.path.dirname(RESULTS), f"rl_update_proximal_{name}.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"seconds_per_update": times, "median": med, "args": vars(args), "model": model_dir,
                   "load_average_before": LOAD_BEFORE}, fh, indent=1)


def _tiny_model() -> str:
    """The default recipe's model shape (its warm start's), random weights."""
    from realscale.models.tiny import build_tiny_model

    return build_tiny_model(os.path.join("runs", "bench_rl_update_model"), family="qwen2", hidden_size=128,
                            num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=256, help="sequences per batch (32 prompts x 8 samples)")
    ap.add_argument("--prompt", type=int, default=24, help="prompt tokens (the chat template around '23+19=')")
    ap.add_argument("--response", type=int, default=17, help="response tokens (a worked answer)")
    ap.add_argument("--proximal", metavar="RECIPE", help="time the proximal log-probs' shortcut on RECIPE instead")
    ap.add_argument("--shared", metavar="RECIPE", help="time RECIPE's update with and without shared prefixes instead")
    ap.add_argument("--samples", type=int, default=8, help="--shared: answers per prompt")
    ap.add_argument("--threads", type=int, default=1,
                    help="--proximal: torch threads (1: what a trainer rank gets beside a server on two cores)")
    args = ap.parse_args()
    if args.proximal:
        return proximal(args)
    if args.shared:
        return shared(args)
    model_dir = _tiny_model()
    times = run_distributed(_rank, 1, model_dir, args.budgets, args.reps, args.seqs, args.prompt, args.response,
                            timeout=1800)[0]
    best_dense = min(times["dense"].values())
    for budget in args.budgets:
        p, d = times["packed"][budget], times["dense"][budget]
        print(f"budget {budget:5d} tokens: packed {p:6.2f} s, dense mask {d:6.2f} s per update "
              f"(the best dense budget / packed here: {best_dense / p:.2f}x)")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump({"seconds_per_update": {impl: {str(k): v for k, v in t.items()} for impl, t in times.items()},
                   "args": vars(args), "load_average_before": LOAD_BEFORE}, fh, indent=1)


if __name__ == "__main__":
    main()

"""Time of one RL policy update (proximal log-probs + 4 PPO mini-batch steps) of the
default recipe's shape, against the packed micro-batch token budget.

On CPU the local layer spec's attention builds a dense block-causal ``T x T`` mask over
each packed row, so the cost of a micro-batch grows with the square of its budget while
the megatron schedule adds a fixed cost per micro-batch: the budget has a sweet spot.
Same model, same batch, one process, one run; writes
``benchmarks/results/rl_update_budget.json``.

    python benchmarks/bench_rl_update.py [--budgets 256 512 1024 2048] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from realscale.parallel.spawn import run_distributed

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


def _rank(model_dir: str, budgets: list[int], reps: int, seqs: int, prompt: int, response: int) -> dict[int, float]:
    from realscale.config import load_config
    from realscale.train.engine import EngineConfig, MegatronEngine
    from realscale.train.actor import split_for_dp, update_policy

    batch = _batch(seqs, prompt, response)
    out = {}
    for budget in budgets:
        cfg = load_config("configs/tiny_cpu.yaml", [f"train.max_tokens_per_micro_batch={budget}"])
        eng = MegatronEngine(EngineConfig(model_path=model_dir, lr=1e-5, max_tokens_per_micro_batch=budget))
        update_policy(eng, split_for_dp(batch, cfg.train.mini_batches, 1)[0], cfg)  # warm-up
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            update_policy(eng, split_for_dp(batch, cfg.train.mini_batches, 1)[0], cfg)
            times.append(time.perf_counter() - t)
        out[budget] = min(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=256, help="sequences per batch (32 prompts x 8 samples)")
    ap.add_argument("--prompt", type=int, default=24, help="prompt tokens (the chat template around '23+19=')")
    ap.add_argument("--response", type=int, default=17, help="response tokens (a worked answer)")
    args = ap.parse_args()
    from realscale.models.tiny import build_tiny_model

    model_dir = build_tiny_model(os.path.join("runs", "bench_rl_update_model"), family="qwen2", hidden_size=128,
                                 num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, seed=0)
    times = run_distributed(_rank, 1, model_dir, args.budgets, args.reps, args.seqs, args.prompt, args.response,
                            timeout=1800)[0]
    best = min(times.values())
    for budget, t in times.items():
        print(f"budget {budget:5d} tokens: {t:6.2f} s per update  ({t / best:.2f}x the best)")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump({"seconds_per_update": {str(k): v for k, v in times.items()}, "args": vars(args)}, fh, indent=1)


if __name__ == "__main__":
    main()

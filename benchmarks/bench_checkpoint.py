"""A trainer rank's checkpoint saves, the first and the ones after it, with and without the
writer's one-time set-up taken beforehand (``Checkpointer.warm_up``, which the trainer
calls while its first batch generates), side by side in one run.

megatron-core's ``torch_dist`` saver starts a spawned manager process for its result
queue on the first save of a process (``realscale.train.checkpoint.start_writer_queue``
says where); every later save reuses it. Each case runs in a fresh rank process (the
queue lives as long as the process), alternating ``cold`` and ``warmed`` for ``--reps``
rounds: the default recipe's model shape (random weights) with its optimizer state
after one update, ``--saves`` saves in a row, each timed. In ``warmed`` the rank first
warms the writer up and waits for it, as the trainer's first-batch wait does.

    python benchmarks/bench_checkpoint.py [--reps 3] [--saves 3]

Writes ``benchmarks/results/checkpoint_first_save.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from realscale.parallel.spawn import run_distributed

LOAD_BEFORE = os.getloadavg()
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoint_first_save.json")


def _rank(model_dir: str, warm: bool, saves: int) -> list[float]:
    import torch

    from bench_rl_update import _batch
    from realscale.config import load_config
    from realscale.train.actor import split_for_dp, update_policy
    from realscale.train.checkpoint import Checkpointer
    from realscale.train.engine import EngineConfig, MegatronEngine

    torch.set_num_threads(1)
    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                   "tiny_cpu.yaml"), [])
    eng = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
    update_policy(eng, split_for_dp(_batch(256, 24, 17), cfg.train.mini_batches, 1)[0], cfg)
    with tempfile.TemporaryDirectory() as root:
        ckpts = Checkpointer(root, keep=1)
        if warm:
            ckpts.warm_up()
            ckpts._warming.join()  # the trainer's first-batch wait covers it
        times = []
        for step in range(1, saves + 1):
            t = time.perf_counter()
            ckpts.save(eng, step, {"step": step})
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()
    from bench_rl_update import _tiny_model

    model_dir = _tiny_model()
    out: dict[str, list[list[float]]] = {"cold": [], "warmed": []}
    for _ in range(args.reps):
        for case in out:
            out[case].append(run_distributed(_rank, 1, model_dir, case == "warmed", args.saves, timeout=600)[0])
    med = {case: [statistics.median(r[i] for r in runs) for i in range(args.saves)] for case, runs in out.items()}
    for case, m in med.items():
        print(f"{case:7s} seconds per save, in order (median of {args.reps}): " + ", ".join(f"{t:.2f}" for t in m))
    print(f"first save: cold / warmed = {med['cold'][0] / med['warmed'][0]:.2f}x")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump({"seconds_per_save": out, "median": med, "args": vars(args), "load_average_before": LOAD_BEFORE},
                  fh, indent=1)


if __name__ == "__main__":
    main()

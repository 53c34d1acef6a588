"""A trainer rank's checkpoint saves, the first and the ones after it, through megatron's own
result queue and through the in-process one realscale uses, side by side in one run.

megatron-core's ``torch_dist`` saver makes its result queue on the first save of a process
in a spawned manager process, which imports torch to unpickle the first results it is sent
(``realscale.train.checkpoint.InProcessResultsQueue`` says where); every later save reuses
it. Our saves are synchronous, so the results never leave the rank and a thread queue does
(``use_in_process_writer_queue``, what ``MegatronEngine.save`` installs). Each case runs in
a fresh rank process (the queue lives as long as the process), alternating ``manager``
and ``in_process`` for ``--reps`` rounds: the default recipe's model shape (random
weights) with its optimizer state after one update, ``--saves`` saves in a row, each
timed, and the CPU-seconds the rank's child processes used (the manager's, and the
writer's forked workers').

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


def _rank(model_dir: str, in_process: bool, saves: int) -> dict[str, object]:
    import psutil
    import torch

    import realscale.train.engine as engine

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
    if not in_process:  # megatron's own queue: MegatronEngine.save installs none
        engine.use_in_process_writer_queue = lambda: None
    me = psutil.Process()
    with tempfile.TemporaryDirectory() as root:
        ckpts = Checkpointer(root, keep=1)
        times = []
        for step in range(1, saves + 1):
            t = time.perf_counter()
            ckpts.save(eng, step, {"step": step})
            times.append(time.perf_counter() - t)
    live = sum(sum(c.cpu_times()[:2]) for c in me.children(recursive=True))
    return {"seconds": times, "children_cpu_s": live + sum(me.cpu_times()[2:4]),
            "children_left": len(me.children(recursive=True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()
    from bench_rl_update import _tiny_model

    model_dir = _tiny_model()
    out: dict[str, list[dict]] = {"manager": [], "in_process": []}
    for _ in range(args.reps):
        for case in out:
            out[case].append(run_distributed(_rank, 1, model_dir, case == "in_process", args.saves, timeout=600)[0])
    med = {case: [statistics.median(r["seconds"][i] for r in runs) for i in range(args.saves)]
           for case, runs in out.items()}
    cpu = {case: statistics.median(r["children_cpu_s"] for r in runs) for case, runs in out.items()}
    for case, m in med.items():
        print(f"{case:10s} seconds per save, in order (median of {args.reps}): " + ", ".join(f"{t:.2f}" for t in m)
              + f"; child processes' CPU {cpu[case]:.2f} s, left running {[r['children_left'] for r in out[case]]}")
    print(f"first save: manager / in_process = {med['manager'][0] / med['in_process'][0]:.2f}x")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump({"runs": out, "median_seconds_per_save": med, "median_children_cpu_s": cpu, "args": vars(args),
                   "load_average_before": LOAD_BEFORE}, fh, indent=1)


if __name__ == "__main__":
    main()

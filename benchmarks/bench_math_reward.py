"""Claim: the math reward checks >= 2,500 numeric answers/s on 2 cores (issue floor 500/s),
symbolic ones at least as fast as math-verify, at >= 99% accuracy on labelled cases.

Compared side by side, same inputs, one run:

- reference: plain math-verify, ``verify(parse("\\boxed{ref}"), parse(completion))`` per
  check, in 1 process and in a ``multiprocessing.Pool`` of 2 (map, chunksize 16).
- ours: ``MathReward(workers=1|2)``: our extraction, the exact fast path, math-verify only
  when the fast path cannot decide, batched IPC, timeouts and a watchdog.

Workloads (no item repeats within a workload, so parse caches do not flatter us):
- numeric: the GSM8K cases of tests/reward/data/math_cases.jsonl plus synthetic GSM-style
  completions (integers, thousands commas, decimals, dollars, fractions, percents);
- symbolic: the hand-written non-numeric cases (symbolic, interval, set, tuple, matrix,
  equation) of the same file.
Accuracy of both is measured on all labelled cases. A fresh pool per measurement; pool
start-up is not timed (a trainer starts it once).

    python benchmarks/bench_math_reward.py [--numeric 4000]

With ``--rollout``, the pattern a rollout process has instead of a batch: checks arrive
one at a time (each answer as its generation finishes, ``--gap-ms`` apart) and each is
awaited by its own task on the event loop. Two ways, alternating, same items:
``in_process`` (what MathReward does: checks the fast path settles run in the caller)
and ``pool`` (every check through the worker pool, as before: ``IN_PROCESS_CHARS = 0``),
and ``harness`` (the arrivals alone, no check: the loop's timers, taken out of both).
Measured: CPU seconds per check, this process and the pool's workers together (what a
rollout process takes from the trainer on a shared machine). Writes
``benchmarks/results/math_reward_rollout.json``.

    python benchmarks/bench_math_reward.py --rollout [--checks 1000] [--gap-ms 5] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import platform
import random
import statistics
import time

import realscale.reward.math_reward as math_reward
from realscale.reward.math_reward import MathReward

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "..", "tests", "reward", "data", "math_cases.jsonl")
RESULTS = os.path.join(HERE, "results", "math_reward.json")
SYMBOLIC_KINDS = {"symbolic", "interval", "set", "tuple", "matrix", "equation"}


def load_cases() -> list[dict]:
    with open(CASES, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def synthetic_numeric(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Unique GSM-style (completion, reference) pairs in varied surface forms."""
    rng = random.Random(seed)
    out: set[tuple[str, str]] = set()
    while len(out) < n:
        x = rng.randint(0, 2_000_000)
        y = x if rng.random() < 0.6 else x + rng.choice([-1, 1, 10, -100])
        form = rng.randrange(6)
        if form == 0:
            c = f"So in total \\boxed{{{y:,}}}."
        elif form == 1:
            c = f"Step by step ... The answer is {y}."
        elif form == 2:
            c = f"She pays ${y}.00 altogether.\n#### {y}"
        elif form == 3:
            c = f"The final answer is ${y}.0$"
        elif form == 4:
            c = f"\\boxed{{\\frac{{{2 * y}}}{{2}}}}"
        else:
            c = f"That is \\boxed{{{y}\\%}} of the total."
        out.add((c, str(x)))
    return sorted(out)


def mv_check(pair: tuple[str, str]) -> bool:
    from math_verify import parse, verify

    completion, reference = pair
    return bool(verify(parse("\\boxed{" + reference + "}"), parse(completion)))


def _quiet() -> None:
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def run_reference(pairs: list[tuple[str, str]], procs: int) -> tuple[float, list[bool]]:
    if procs == 1:
        _quiet()
        mv_check(("1", "1"))  # imports and first-call set-up are not timed
        t0 = time.perf_counter()
        verdicts = [mv_check(p) for p in pairs]
        return time.perf_counter() - t0, verdicts
    with mp.get_context("spawn").Pool(procs, initializer=_quiet) as pool:
        pool.map(mv_check, [("1", "1")] * procs * 4, chunksize=1)  # warm every worker
        t0 = time.perf_counter()
        verdicts = pool.map(mv_check, pairs, chunksize=16)
        return time.perf_counter() - t0, verdicts


def run_ours(pairs: list[tuple[str, str]], workers: int) -> tuple[float, list[bool]]:
    with MathReward(workers=workers, timeout=5.0) as reward:
        reward.score_batch([("\\boxed{\\frac{1}{2}}", "0.5")] * workers * 2)  # workers up and warm
        t0 = time.perf_counter()
        results = reward.score_batch(pairs)
        return time.perf_counter() - t0, [r.value == 1.0 for r in results]


def arith_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """The default recipe's answers: direct or worked sums ("(3+9=12,2+1+1=4)42"), right or not."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 29), rng.randint(0, 29)
        said = a + b if rng.random() < 0.7 else a + b + rng.choice([-10, -1, 1, 10])
        worked = f"({a % 10}+{b % 10}={a % 10 + b % 10},{a // 10}+{b // 10}+{(a % 10 + b % 10) // 10}=" \
                 f"{a // 10 + b // 10 + (a % 10 + b % 10) // 10}){said}"
        out.append((worked if rng.random() < 0.5 else str(said), str(a + b)))
    return out


def _cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


async def _trickle(reward: MathReward | None, pairs: list[tuple[str, str]], gap_s: float) -> list[float]:
    async def one(i: int, pair: tuple[str, str]) -> float:
        await asyncio.sleep(i * gap_s)
        return 0.0 if reward is None else (await reward.score(*pair)).value

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(pairs))))


def rollout_pattern(checks: int, gap_ms: float, reps: int) -> None:
    """CPU per check with one check arriving at a time: in the caller vs through the pool."""
    pairs = (arith_pairs(checks // 2) + synthetic_numeric(checks - checks // 2, seed=1))
    random.Random(2).shuffle(pairs)
    keep = math_reward.IN_PROCESS_CHARS
    runs: dict[str, list[dict[str, float]]] = {"in_process": [], "pool": [], "harness": []}
    load = os.getloadavg()
    with MathReward(workers=2, timeout=5.0) as reward:
        math_reward.IN_PROCESS_CHARS = 0
        reward.score_batch([("\\boxed{\\frac{1}{2}}", "0.5")] * 4)  # workers up and warm
        verdicts: dict[str, list[float]] = {}
        for _ in range(reps):
            for mode in ("in_process", "pool", "harness"):
                math_reward.IN_PROCESS_CHARS = keep if mode == "in_process" else 0
                pids = [os.getpid(), *reward._pool.pids()]
                cpu0, t0 = _cpu_seconds(pids), time.perf_counter()
                verdicts[mode] = asyncio.run(_trickle(None if mode == "harness" else reward, pairs, gap_ms / 1000))
                cpu, wall = _cpu_seconds(pids) - cpu0, time.perf_counter() - t0
                runs[mode].append({"cpu_ms_per_check": 1000 * cpu / len(pairs), "wall_s": wall})
                print(f"{mode:10} {1000 * cpu / len(pairs):7.3f} ms CPU/check, wall {wall:.2f} s", flush=True)
        math_reward.IN_PROCESS_CHARS = keep
    assert verdicts["in_process"] == verdicts["pool"], "the two ways disagree"
    med = {m: statistics.median(r["cpu_ms_per_check"] for r in rs) for m, rs in runs.items()}
    net = {m: med[m] - med["harness"] for m in ("in_process", "pool")}  # the arrivals' own cost taken out
    print(f"median CPU per check: in_process {med['in_process']:.3f} ms, pool {med['pool']:.3f} ms, "
          f"the arrivals alone {med['harness']:.3f} ms; net of them {net['in_process']:.3f} vs {net['pool']:.3f} ms "
          f"({net['pool'] / net['in_process']:.1f}x)")
    out = os.path.join(HERE, "results", "math_reward_rollout.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                   "load_before": load, "load_after": os.getloadavg(), "checks": len(pairs), "gap_ms": gap_ms,
                   "runs": runs, "median_cpu_ms_per_check": med, "net_of_arrivals_ms": net,
                   "ratio_net": net["pool"] / net["in_process"]},
                  fh, indent=2)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numeric", type=int, default=4000, help="numeric checks per measurement")
    ap.add_argument("--rollout", action="store_true", help="one check at a time, in the caller vs through the pool")
    ap.add_argument("--checks", type=int, default=1000)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.rollout:
        _quiet()
        rollout_pattern(args.checks, args.gap_ms, args.reps)
        return
    _quiet()
    cases = load_cases()
    labelled = [(c["completion"], c["reference"]) for c in cases]
    labels = [c["equal"] for c in cases]
    gsm = [(c["completion"], c["reference"]) for c in cases if c["source"].startswith("gsm8k:")]
    numeric = gsm + synthetic_numeric(max(0, args.numeric - len(gsm)))
    symbolic = [(c["completion"], c["reference"]) for c in cases if c["kind"] in SYMBOLIC_KINDS]
    print(f"{len(cases)} labelled cases; numeric workload {len(numeric)}, symbolic {len(symbolic)}; "
          f"{os.cpu_count()} CPUs, {platform.python_version()}")

    rows = []
    for name, fn in (("math-verify, 1 process", lambda p: run_reference(p, 1)),
                     ("math-verify, Pool(2)", lambda p: run_reference(p, 2)),
                     ("ours, MathReward(workers=1)", lambda p: run_ours(p, 1)),
                     ("ours, MathReward(workers=2)", lambda p: run_ours(p, 2))):
        t_num, _ = fn(numeric)
        t_sym, _ = fn(symbolic)
        _, verdicts = fn(labelled)
        acc = sum(v == want for v, want in zip(verdicts, labels)) / len(labels)
        rows.append({"impl": name, "numeric_per_s": len(numeric) / t_num, "symbolic_per_s": len(symbolic) / t_sym,
                     "accuracy": acc})
    ref2 = rows[1]
    print(f"\n{'implementation':32} {'numeric/s':>10} {'symbolic/s':>11} {'accuracy':>9} {'num x':>7} {'sym x':>7}")
    for r in rows:
        r["numeric_ratio_vs_mv2"] = r["numeric_per_s"] / ref2["numeric_per_s"]
        r["symbolic_ratio_vs_mv2"] = r["symbolic_per_s"] / ref2["symbolic_per_s"]
        print(f"{r['impl']:32} {r['numeric_per_s']:10,.0f} {r['symbolic_per_s']:11,.1f} {r['accuracy']:9.2%} "
              f"{r['numeric_ratio_vs_mv2']:7.2f} {r['symbolic_ratio_vs_mv2']:7.2f}")
    print("(ratios vs math-verify Pool(2); accuracy on all labelled cases)")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump({"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                   "cases": len(cases), "numeric_items": len(numeric), "symbolic_items": len(symbolic),
                   "rows": rows}, fh, indent=2)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

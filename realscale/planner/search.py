"""Search for the placement of every role of an RL step: a mesh and a (dp, tp, pp) each
(and for a mixture-of-experts model's training roles, an expert-parallel degree ep).

Two modes:

- ``colocated`` (ReaL, arXiv 2406.14088): synchronous; roles time-share GPUs. Step time is
  the makespan of a list schedule (a role starts when its inputs are ready and the GPUs of
  its mesh are free), plus moving the actor's weights from the training layout to the
  generation layout, plus offloading/reloading optimizer state when the training mesh is
  shared. Generation pays the long tail (``gen_len`` steps per wave). The actor generates
  and trains on every GPU of the cluster (each trainer rank is one generation rank: the
  runtime's colocated mode, :mod:`realscale.serve.colocated`); the other roles are
  placed freely.
- ``disaggregated`` (AReaL, arXiv 2505.24298): generation on its own GPUs, training roles on
  the rest. With staleness bound eta >= 1, generation and training overlap:
  ``step = max(T_gen, T_train) + T_sync``; with eta = 0 they alternate:
  ``T_gen + T_train + T_sync``. Asynchronous generation keeps its batch full (mean length).

``mode="auto"`` searches both and keeps the faster. Search: exhaustive (pure Python) when
the product of the roles' option counts is small, otherwise simulated annealing over the
joint assignment (``csrc/plan_search.cpp``; :func:`anneal_py` is its Python twin),
started from structured seeds (all roles on the whole cluster; generation on the first
k nodes and the rest on the others, for every k).

How ours departs from ReaL: ReaL's MCMC runs over an execution-plan graph with a
profiled simulator; ours runs over role placements with the closed-form cost model of
:mod:`realscale.planner.cost`. Options that cannot fit in memory are removed before the
search (each with its reason, see :func:`role_options`).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

from realscale import kernels
from realscale.parallel.mesh import Cluster, LayoutError, Mesh, Strategy
from realscale.parallel.model_spec import ModelSpec
from realscale.planner import cost as C
from realscale.planner.hardware import GPU, Efficiency

MODES = ("colocated", "disaggregated")
INFEASIBLE = 1e18


@dataclass(frozen=True)
class Role:
    name: str
    kind: str                 # generate | train | infer
    model: str = "actor"      # which spec it runs (actor, ref, critic, reward)
    deps: tuple[str, ...] = ()


def default_roles(ref: bool = True, critic: bool = False) -> list[Role]:
    """The roles of one PPO/GRPO step, in dependency (topological) order."""
    roles = [Role("actor_gen", "generate")]
    after_gen: list[str] = ["actor_gen"]
    if ref:
        roles.append(Role("ref_inf", "infer", "ref", ("actor_gen",)))
        after_gen.append("ref_inf")
    if critic:
        roles.append(Role("critic_inf", "infer", "critic", ("actor_gen",)))
        after_gen.append("critic_inf")
    roles.append(Role("actor_train", "train", "actor", tuple(after_gen)))
    if critic:
        roles.append(Role("critic_train", "train", "critic", tuple(after_gen)))
    return roles


@dataclass
class Problem:
    spec: ModelSpec                     # the actor
    cluster: Cluster
    gpu: GPU
    workload: C.Workload
    roles: list[Role]
    eff: Efficiency = field(default_factory=Efficiency)
    models: dict[str, ModelSpec] = field(default_factory=dict)  # ref/critic specs; default: the actor's

    def model(self, name: str) -> ModelSpec:
        return self.models.get(name, self.spec)

    def __post_init__(self) -> None:
        names = [r.name for r in self.roles]
        if names.count("actor_gen") != 1 or names.count("actor_train") != 1:
            raise LayoutError("roles: need exactly one 'actor_gen' and one 'actor_train'")
        for i, r in enumerate(self.roles):
            if r.kind not in ("generate", "train", "infer"):
                raise LayoutError(f"role {r.name}: kind {r.kind!r} is not generate, train or infer")
            for d in r.deps:
                if d not in names[:i]:
                    raise LayoutError(f"role {r.name}: dependency {d!r} is not an earlier role")


@dataclass
class Options:
    """All placements of one role, as arrays (one entry per (mesh, strategy))."""

    lo: np.ndarray
    hi: np.ndarray
    seconds: np.ndarray
    mem_gb: np.ndarray
    state_gb: np.ndarray
    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    refused: dict[str, str] = field(default_factory=dict)  # strategy -> why
    recompute: np.ndarray | None = None  # train roles: 1 where the option needs full recomputation
    ep: np.ndarray | None = None  # expert parallelism (a MoE model's train roles); None: 1 everywhere

    def __len__(self) -> int:
        return len(self.lo)

    def strategy(self, i: int) -> Strategy:
        ep = 1 if self.ep is None else int(self.ep[i])
        return Strategy(int(self.dp[i]), int(self.tp[i]), int(self.pp[i]), ep)

    def mesh(self, i: int) -> Mesh:
        return Mesh(int(self.lo[i]), int(self.hi[i] - self.lo[i]))


def _strategies(size: int, gpus_per_node: int) -> list[Strategy]:
    out = []
    for tp in range(1, min(size, gpus_per_node) + 1):
        if size % tp or gpus_per_node % tp:
            continue
        for pp in range(1, size // tp + 1):
            if (size // tp) % pp == 0:
                out.append(Strategy(size // (tp * pp), tp, pp))
    return out


def _with_experts(spec: ModelSpec, role: Role, strategies: list[Strategy]) -> list[Strategy]:
    """A MoE model's train roles also take every expert-parallel degree: the divisors of dp
    that divide the experts (Megatron carves ep out of dp). Dense models, generation
    (servers hold every expert) and forward-only roles keep ep = 1."""
    if role.kind != "train" or not spec.num_experts:
        return strategies
    return [Strategy(s.dp, s.tp, s.pp, ep) for s in strategies for ep in range(1, s.dp + 1)
            if s.dp % ep == 0 and spec.num_experts % ep == 0]


def role_cost(p: Problem, role: Role, s: Strategy, mode: str) -> C.RoleCost:
    spec = p.model(role.model)
    g = p.cluster.gpus_per_node
    if role.kind == "train":
        return C.train_cost(spec, s, p.workload, p.gpu, p.eff, g)
    if role.kind == "infer":
        return C.infer_cost(spec, s, p.workload, p.gpu, p.eff, g)
    asynchronous = mode == "disaggregated" and p.workload.max_staleness > 0
    return C.generate_cost(spec, s, p.workload, p.gpu, p.eff, g, asynchronous)


def role_options(p: Problem, role: Role, mode: str, meshes: list[Mesh] | None = None) -> Options:
    """Every feasible (mesh, strategy) of ``role``; refused strategies keep their reason."""
    by_size: dict[int, list[int]] = {}
    for m in meshes if meshes is not None else p.cluster.meshes():
        by_size.setdefault(m.size, []).append(m.start)
    cols: dict[str, list] = {k: [] for k in ("lo", "hi", "seconds", "mem_gb", "state_gb", "dp", "tp", "pp",
                                             "recompute", "ep")}
    refused: dict[str, str] = {}
    for size, starts in sorted(by_size.items()):
        st = np.asarray(starts, np.int64)
        for s in _with_experts(p.model(role.model), role, _strategies(size, p.cluster.gpus_per_node)):
            try:
                rc = role_cost(p, role, s, mode)
            except LayoutError as exc:
                refused[str(s)] = str(exc)
                continue
            if not math.isfinite(rc.seconds):
                refused[str(s)] = rc.note
                continue
            n = len(st)
            cols["lo"].append(st)
            cols["hi"].append(st + size)
            for k, v in (("seconds", rc.seconds), ("mem_gb", rc.mem_gb), ("state_gb", rc.state_gb),
                         ("dp", s.dp), ("tp", s.tp), ("pp", s.pp), ("recompute", int(rc.recompute == "full")),
                         ("ep", s.ep)):
                cols[k].append(np.full(n, v, np.float64 if k in ("seconds", "mem_gb", "state_gb") else np.int64))
    if not cols["lo"]:
        why = "; ".join(f"{k}: {v}" for k, v in list(refused.items())[:4])
        raise LayoutError(f"role {role.name}: no layout fits on {p.cluster.n_gpus} x {p.gpu.name} ({why})")
    arrays = {k: np.concatenate(v) for k, v in cols.items()}
    return Options(**arrays, refused=refused)


# --------------------------------------------------------------------------- evaluation


@dataclass
class Instance:
    """Everything the evaluator needs, flat (shared by the Python and C++ paths)."""

    opts: list[Options]
    deps: list[list[int]]
    kinds: list[int]           # 0 generate, 1 train, 2 infer
    gen: int
    train: int
    mode: int                  # 0 colocated, 1 disaggregated
    eta: int
    consts: list[float]        # see _consts


def _consts(p: Problem) -> list[float]:
    """[actor weight bytes, nvlink GB/s, ib GB/s, link eff, update overhead s, pcie GB/s, gpus/node]."""
    return [float(p.spec.n_params * p.spec.itemsize), p.gpu.nvlink_gbps, p.gpu.ib_gbps, p.eff.link,
            p.eff.weight_update_overhead_s, p.gpu.pcie_gbps, float(p.cluster.gpus_per_node)]


def build_instance(p: Problem, mode: str, meshes: list[Mesh] | None = None) -> Instance:
    if mode not in MODES:
        raise LayoutError(f"mode {mode!r} is not one of {MODES} (or 'auto')")
    names = [r.name for r in p.roles]
    kinds = [{"generate": 0, "train": 1, "infer": 2}[r.kind] for r in p.roles]
    whole = [Mesh(0, p.cluster.n_gpus)]
    actor = ("actor_gen", "actor_train")  # colocated: on the whole cluster (module docstring)
    return Instance([role_options(p, r, mode, whole if meshes is None and mode == "colocated" and r.name in actor
                                  else meshes) for r in p.roles],
                    [[names.index(d) for d in r.deps] for r in p.roles], kinds,
                    names.index("actor_gen"), names.index("actor_train"), MODES.index(mode),
                    p.workload.max_staleness, _consts(p))


def _overlap(a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> int:
    return max(0, min(a_hi, b_hi) - max(a_lo, b_lo))


def sync_seconds(inst: Instance, gi: int, ti: int) -> float:
    """Weight move from actor_train option ``ti`` to actor_gen option ``gi`` (same formula
    as :func:`realscale.planner.cost.weight_sync_seconds`, on raw numbers). A MoE trainer's
    ep is not in the shard it is assumed to hold (tp x pp only): optimistic for colocated
    expert-parallel layouts; a plan's real bytes come from ``plan_reshard``."""
    w_bytes, nvl, ib, link, overhead, _, gpn = inst.consts
    go, to = inst.opts[inst.gen], inst.opts[inst.train]
    glo, ghi, tlo, thi = int(go.lo[gi]), int(go.hi[gi]), int(to.lo[ti]), int(to.hi[ti])
    frac = _overlap(glo, ghi, tlo, thi) / (ghi - glo)
    gen_tp, div = int(go.tp[gi]), int(to.tp[ti] * to.pp[ti])
    held = min(1.0, gen_tp / div) if frac >= 1.0 else 0.0
    g = int(gpn)
    same_nodes = glo // g >= tlo // g and (ghi - 1) // g <= (thi - 1) // g
    bw = nvl if same_nodes else ib
    return w_bytes / gen_tp * (1.0 - held) / (bw * 1e9 * link) + (0.0 if frac > 0 else overhead)


def evaluate(inst: Instance, choice: list[int]) -> float:
    """Step seconds of a joint choice (``INFEASIBLE`` when the mode forbids it)."""
    R = len(choice)
    lo = [int(inst.opts[r].lo[choice[r]]) for r in range(R)]
    hi = [int(inst.opts[r].hi[choice[r]]) for r in range(R)]
    t = [float(inst.opts[r].seconds[choice[r]]) for r in range(R)]
    pcie = inst.consts[5]
    for r in range(R):
        if inst.kinds[r] == 1 and any(q != r and _overlap(lo[r], hi[r], lo[q], hi[q]) for q in range(R)):
            t[r] += 2.0 * float(inst.opts[r].state_gb[choice[r]]) / pcie  # offload + reload state
    sync = sync_seconds(inst, choice[inst.gen], choice[inst.train])
    if inst.mode == 1 and any(q != inst.gen and _overlap(lo[inst.gen], hi[inst.gen], lo[q], hi[q])
                              for q in range(R)):
        return INFEASIBLE
    end = [0.0] * R
    for r in range(R):
        if inst.mode == 1 and r == inst.gen:
            continue
        start = 0.0
        if inst.mode == 0 and r == inst.gen:
            start = sync
        for d in inst.deps[r]:
            if not (inst.mode == 1 and d == inst.gen):
                start = max(start, end[d])
        for q in range(r):
            if _overlap(lo[r], hi[r], lo[q], hi[q]) and not (inst.mode == 1 and q == inst.gen):
                start = max(start, end[q])
        end[r] = start + t[r]
    if inst.mode == 0:
        return max(end)
    t_train = max(end[r] for r in range(R) if r != inst.gen)
    t_gen = t[inst.gen]
    return (t_gen + t_train + sync) if inst.eta == 0 else max(t_gen, t_train) + sync


def exhaustive(inst: Instance, limit: int = 2_000_000) -> tuple[list[int], float]:
    """The brute-force optimum over every joint choice (refuses more than ``limit``)."""
    sizes = [len(o) for o in inst.opts]
    total = math.prod(sizes)
    if total > limit:
        raise LayoutError(f"exhaustive search over {total:,} joint choices exceeds the limit of {limit:,}; "
                          "use the annealing search")
    best, best_c = [0] * len(sizes), math.inf
    for choice in itertools.product(*(range(n) for n in sizes)):
        c = evaluate(inst, list(choice))
        if c < best_c:
            best, best_c = list(choice), c
    return best, best_c


def _best_on(opts: Options, lo: int, hi: int) -> int:
    """The fastest option of a role whose mesh is exactly [lo, hi), or -1."""
    idx = np.nonzero((opts.lo == lo) & (opts.hi == hi))[0]
    if len(idx) == 0:
        return -1
    return int(idx[np.argmin(opts.seconds[idx])])


def seeds(inst: Instance, cluster: Cluster) -> list[list[int]]:
    """Structured starting points: everything on the whole cluster; generation on the
    first k nodes (or an aligned slice of node 0) with everything else on the rest."""
    n = cluster.n_gpus
    splits: list[tuple[int, int, int, int]] = [(0, n, 0, n)]
    g = cluster.gpus_per_node
    for k in range(1, cluster.nodes):
        splits.append((0, k * g, k * g, n))
    if cluster.nodes == 1:
        size = g // 2
        while size >= 1:
            splits.append((0, size, size, 2 * size) if 2 * size <= g else (0, size, size, n))
            size //= 2
    out = []
    for glo, ghi, rlo, rhi in splits:
        choice = []
        for r, opts in enumerate(inst.opts):
            choice.append(_best_on(opts, glo, ghi) if r == inst.gen else _best_on(opts, rlo, rhi))
        if min(choice) >= 0:
            out.append(choice)
    return out or [[0] * len(inst.opts)]


def anneal_py(inst: Instance, init: list[int], iters: int, seed: int) -> tuple[list[int], float]:
    """Simulated annealing over joint choices (the Python twin of plan_search.cpp)."""
    rng = random.Random(seed)
    cur = list(init)
    cur_c = evaluate(inst, cur)
    best, best_c = list(cur), cur_c
    t0 = 0.05 * min(cur_c, 1e6)
    for it in range(iters):
        temp = t0 * (1e-4 ** (it / max(1, iters - 1)))
        r = rng.randrange(len(cur))
        n = len(inst.opts[r])
        old = cur[r]
        cur[r] = rng.randrange(n) if rng.random() < 0.5 else min(n - 1, max(0, old + rng.randint(-8, 8)))
        c = evaluate(inst, cur)
        if c <= cur_c or rng.random() < math.exp(-(c - cur_c) / max(temp, 1e-12)):
            cur_c = c
            if c < best_c:
                best, best_c = list(cur), c
        else:
            cur[r] = old
    return best, best_c


def _anneal(inst: Instance, init: list[int], iters: int, seed: int) -> tuple[list[int], float]:
    mod = kernels.load("plan_search")
    if mod is None:
        return anneal_py(inst, init, iters, seed)
    import torch

    def cat(key: str, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(np.concatenate([getattr(o, key) for o in inst.opts]), dtype=dtype))

    offsets = torch.tensor([0] + list(itertools.accumulate(len(o) for o in inst.opts)), dtype=torch.int64)
    deps = torch.zeros(len(inst.opts), len(inst.opts), dtype=torch.int64)
    for r, ds in enumerate(inst.deps):
        for d in ds:
            deps[r, d] = 1
    choice, c = mod.anneal(offsets, cat("lo", np.int64), cat("hi", np.int64), cat("seconds", np.float64),
                           cat("state_gb", np.float64), cat("tp", np.int64),
                           torch.from_numpy((np.concatenate([o.tp * o.pp for o in inst.opts])).astype(np.int64)),
                           torch.tensor(inst.kinds, dtype=torch.int64), deps, inst.gen, inst.train, inst.mode,
                           inst.eta, torch.tensor(inst.consts, dtype=torch.float64),
                           torch.tensor(init, dtype=torch.int64), iters, seed)
    return [int(x) for x in choice.tolist()], float(c)


@dataclass
class SearchResult:
    mode: str
    choice: list[int]
    step_seconds: float
    instance: Instance
    method: str
    search_seconds: float


def search_mode(p: Problem, mode: str, iters: int = 200_000, restarts: int = 3, seed: int = 0,
                exhaustive_limit: int = 200_000) -> SearchResult:
    """The best placement for one mode: exhaustive when small, annealing otherwise."""
    t0 = time.perf_counter()
    inst = build_instance(p, mode)
    total = math.prod(len(o) for o in inst.opts)
    if total <= exhaustive_limit:
        choice, c = exhaustive(inst, exhaustive_limit)
        method = "exhaustive"
    else:
        starts = sorted(seeds(inst, p.cluster), key=lambda ch: evaluate(inst, ch))
        choice, c = starts[0], evaluate(inst, starts[0])
        for k in range(restarts):
            ch, cc = _anneal(inst, starts[k % len(starts)], iters, seed + k)
            if cc < c:
                choice, c = ch, cc
        method = "annealing"
    return SearchResult(mode, choice, c, inst, method, time.perf_counter() - t0)


def search(p: Problem, mode: str = "auto", **kw) -> SearchResult:
    """The best placement; ``mode="auto"`` tries both modes and keeps the faster."""
    modes = MODES if mode == "auto" else (mode,)
    results = []
    for m in modes:
        try:
            results.append(search_mode(p, m, **kw))
        except LayoutError:
            if mode != "auto":
                raise
    if not results:
        raise LayoutError(f"no feasible plan in any mode for {p.cluster.n_gpus} x {p.gpu.name}")
    return min(results, key=lambda r: r.step_seconds)


def evaluate_placements(p: Problem, placements: dict[str, tuple[Mesh, Strategy]], mode: str) -> tuple[float, Instance, list[int]]:
    """Step seconds of a given placement (e.g. a published configuration) under the same
    cost model; raises :class:`LayoutError` saying why a role's placement is refused."""
    missing = [r.name for r in p.roles if r.name not in placements]
    if missing:
        raise LayoutError(f"placement lacks roles {missing}")
    meshes = sorted({m for m, _ in placements.values()}, key=lambda m: (m.start, m.size))
    inst = build_instance(p, mode, meshes)
    choice = []
    for r, role in enumerate(p.roles):
        mesh, s = placements[role.name]
        o = inst.opts[r]
        hit = np.nonzero((o.lo == mesh.start) & (o.hi == mesh.end) & (o.dp == s.dp) & (o.tp == s.tp) & (o.pp == s.pp)
                         & (o.ep == s.ep))[0]
        if len(hit) == 0:
            raise LayoutError(f"role {role.name}: {s} on {mesh} is refused: {o.refused.get(str(s), 'not a valid layout')}")
        choice.append(int(hit[0]))
    return evaluate(inst, choice), inst, choice

"""A plan: every role's mesh and strategy, with the cost model's estimates.

``Plan(roles: {role: Placement(mesh, strategy)})``, YAML in and out, printed as a table.
The YAML is what ``realscale plan --out`` writes and what a train recipe names in
``planner.plan``::

    mode: disaggregated
    cluster: {nodes: 16, gpus_per_node: 8, gpu: H100}
    roles:
      actor_gen:   {mesh: "0:512", strategy: d64t8p1}
      actor_train: {mesh: "512:1024", strategy: d16t4p8, recompute: full}
    estimate: {step_seconds: 123.4, tokens_per_second: 1.2e5}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from realscale.parallel.mesh import Cluster, LayoutError, Mesh, Strategy


@dataclass(frozen=True)
class Placement:
    mesh: Mesh
    strategy: Strategy
    seconds: float = math.nan
    mem_gb: float = math.nan
    recompute: str = "none"  # train roles: the activation recomputation the memory estimate assumes

    def __post_init__(self) -> None:
        if self.mesh.size != self.strategy.world:
            raise LayoutError(f"placement {self.strategy} on {self.mesh}: needs {self.strategy.world} GPUs, "
                              f"the mesh has {self.mesh.size}")


@dataclass
class Plan:
    roles: dict[str, Placement]
    mode: str = "colocated"
    cluster: Cluster | None = None
    gpu: str = ""
    step_seconds: float = math.nan
    tokens_per_second: float = math.nan
    extra: dict = field(default_factory=dict)

    def check(self) -> None:
        if self.cluster is not None:
            for name, pl in self.roles.items():
                try:
                    pl.mesh.check(self.cluster)
                except LayoutError as exc:
                    raise LayoutError(f"role {name}: {exc}") from None

    # ------------------------------------------------------------------ YAML
    def to_dict(self) -> dict:
        out: dict = {"mode": self.mode}
        if self.cluster is not None:
            out["cluster"] = {"nodes": self.cluster.nodes, "gpus_per_node": self.cluster.gpus_per_node,
                              "gpu": self.gpu}
        out["roles"] = {}
        for name, pl in self.roles.items():
            entry: dict = {"mesh": f"{pl.mesh.start}:{pl.mesh.end}", "strategy": str(pl.strategy)}
            if not math.isnan(pl.seconds):
                entry["seconds"] = round(pl.seconds, 3)
                entry["mem_gb"] = round(pl.mem_gb, 2)
            if pl.recompute != "none":
                entry["recompute"] = pl.recompute  # the engine turns it on (train.recompute=auto)
            out["roles"][name] = entry
        if not math.isnan(self.step_seconds):
            out["estimate"] = {"step_seconds": round(self.step_seconds, 3),
                               "tokens_per_second": round(self.tokens_per_second, 1), **self.extra}
        return out

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict, origin: str = "plan") -> "Plan":
        if not isinstance(data, dict) or not isinstance(data.get("roles"), dict) or not data["roles"]:
            raise LayoutError(f"{origin}: expected a mapping with a non-empty 'roles' mapping")
        roles = {}
        for name, entry in data["roles"].items():
            if not isinstance(entry, dict) or "mesh" not in entry or "strategy" not in entry:
                raise LayoutError(f"{origin}: role {name!r} needs 'mesh' (\"start:end\") and 'strategy' (e.g. d4t2p1)")
            roles[str(name)] = Placement(_parse_mesh(str(entry["mesh"]), f"{origin}: role {name}"),
                                         Strategy.parse(str(entry["strategy"])),
                                         float(entry.get("seconds", math.nan)), float(entry.get("mem_gb", math.nan)),
                                         _recompute(entry.get("recompute", "none"), f"{origin}: role {name}"))
        cluster, gpu = None, ""
        if "cluster" in data:
            c = data["cluster"]
            cluster, gpu = Cluster(int(c["nodes"]), int(c["gpus_per_node"])), str(c.get("gpu", ""))
        est = data.get("estimate", {}) or {}
        plan = cls(roles, str(data.get("mode", "colocated")), cluster, gpu,
                   float(est.get("step_seconds", math.nan)), float(est.get("tokens_per_second", math.nan)))
        plan.check()
        return plan

    @classmethod
    def from_yaml(cls, text: str, origin: str = "plan") -> "Plan":
        import yaml

        return cls.from_dict(yaml.safe_load(text), origin)

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path, encoding="utf-8") as fh:
            return cls.from_yaml(fh.read(), path)

    # ------------------------------------------------------------------ table
    def table(self) -> str:
        ep = any(pl.strategy.ep > 1 for pl in self.roles.values())  # a column only when experts are split
        rows = [("role", "mesh", "dp", "tp", "pp", *(("ep",) if ep else ()), "time (s)", "mem/GPU (GB)")]
        for name, pl in self.roles.items():
            s = pl.strategy
            rows.append((name, str(pl.mesh), str(s.dp), str(s.tp), str(s.pp), *((str(s.ep),) if ep else ()),
                         "-" if math.isnan(pl.seconds) else f"{pl.seconds:.1f}",
                         "-" if math.isnan(pl.mem_gb) else f"{pl.mem_gb:.1f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if not math.isnan(self.step_seconds):
            lines.append(f"mode {self.mode}: estimated step {self.step_seconds:.1f} s, "
                         f"{self.tokens_per_second:,.0f} tokens/s (cost-model estimate, not measured)")
        return "\n".join(lines)


def _recompute(value: object, where: str) -> str:
    if value not in ("none", "selective", "full"):
        raise LayoutError(f"{where}: recompute {value!r} is not one of none, selective, full")
    return str(value)


def _parse_mesh(text: str, where: str) -> Mesh:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise LayoutError(f"{where}: mesh {text!r} must be 'start:end' GPU ids, e.g. '0:16'") from None
    if b <= a:
        raise LayoutError(f"{where}: mesh {text!r} is empty")
    return Mesh(a, b - a)


def plan_from_search(result, problem) -> Plan:  # noqa: ANN001 - SearchResult, Problem (avoid import cycle)
    inst = result.instance
    roles = {}
    for r, role in enumerate(problem.roles):
        o, c = inst.opts[r], result.choice[r]
        full = o.recompute is not None and bool(o.recompute[c])
        roles[role.name] = Placement(o.mesh(c), o.strategy(c), float(o.seconds[c]), float(o.mem_gb[c]),
                                     "full" if full else "none")
    tps = problem.workload.train_tokens / result.step_seconds
    return Plan(roles, result.mode, problem.cluster, problem.gpu.name, result.step_seconds, tps,
                {"search": result.method, "search_seconds": round(result.search_seconds, 2)})

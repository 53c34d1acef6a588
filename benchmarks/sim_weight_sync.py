"""Predicted weight-sync seconds per RL step for 7B, 32B and a 235B-class model on H100
nodes, by the path each engine's update takes (realscale/sim/build.py ``sync_seconds``):
the resharder's plan (embedded servers, vLLM's shard-to-shard ``m2n``), SGLang's per-stage
broadcast groups, and the funnel through trainer rank 0 (vLLM's broadcast engine, and
SGLang's before per-stage groups). Moving seconds only (the pause/resume around them is
left out: it depends on the engine's pause, not on the path).

These are the cost model's numbers at the H100 profile's link speeds times its link
efficiency, not measurements: no GPU has run this code. The 7B and 32B layouts are the
shipped plans' (launch/slurm/plans/ppo_{7b,32b}.yaml). The 235B-class model is a *dense*
stand-in with Qwen3-235B-A22B's parameter bytes (realscale trains dense families only; a
MoE's expert shards would move differently), on 64 training nodes (d8 t4 p16: its 4
key/value groups allow tp4 at most) and 64 generation nodes (128 servers of tp4).

    python benchmarks/sim_weight_sync.py      # writes results/sim_weight_sync.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from realscale.parallel.mesh import Strategy  # noqa: E402
from realscale.parallel.model_spec import known_model, transformer_spec  # noqa: E402
from realscale.planner.hardware import builtin_profile  # noqa: E402
from realscale.planner.plan import Plan  # noqa: E402
from realscale.sim.build import WEIGHT_PATHS, RunLayout, sync_seconds  # noqa: E402
from realscale.sim.recipe import layout_from_plan  # noqa: E402


def cases() -> list[tuple[str, object, RunLayout]]:
    out = []
    for size in ("7b", "32b"):
        plan = Plan.load(os.path.join(ROOT, "launch", "slurm", "plans", f"ppo_{size}.yaml"))
        out.append((f"qwen2-{size}", known_model(f"qwen2-{size}"), layout_from_plan(plan, 8)))
    # dense, Qwen3-235B-A22B's hidden size, heads and vocabulary; 96 layers (94 there: 96
    # splits into 16 stages) with the FFN widened to its total parameter count (~235B)
    big = transformer_spec(hidden=4096, n_layers=96, n_heads=64, n_kv_heads=4, ffn=194_000, vocab=151936,
                           head_dim=128, qkv_bias=False, qk_norm=True)
    out.append(("235B-class (dense stand-in)", big, RunLayout(4, 128, Strategy(8, 4, 16))))
    return out


def main() -> None:
    hw = builtin_profile("H100")
    hw = dataclasses.replace(hw, eff=dataclasses.replace(hw.eff, weight_update_overhead_s=0.0))
    rows = []
    for name, spec, layout in cases():
        row = {"model": name, "params_b": round(spec.n_params / 1e9, 1), "layout": layout.describe(),
               **{path: round(sync_seconds(spec, hw, layout, path=path), 2) for path in WEIGHT_PATHS}}
        rows.append(row)
        print(f"{name:30s} {row['params_b']:6.1f}B  reshard {row['reshard']:7.2f} s  "
              f"per-stage broadcast {row['stage_broadcast']:7.2f} s  funnel {row['funnel']:7.2f} s   {layout.describe()}")
    out = os.path.join(ROOT, "benchmarks", "results", "sim_weight_sync.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"profile": "H100 (builtin)", "link_efficiency": hw.eff.link, "ib_gbps": hw.gpu.ib_gbps,
                   "nvlink_gbps": hw.gpu.nvlink_gbps, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

"""Per-step medians of finished runs, side by side: what BENCHMARKS.md quotes for whole runs.

    python benchmarks/run_medians.py RUN_DIR [RUN_DIR ...]

Reads each run's ``metrics.jsonl`` (the trained steps) and prints, per run, the medians of
step time, train time, the trainer's wait for a batch, the weight sync (seconds, bytes),
answer length and interrupted requests, and the mean reward of the last five steps.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KEYS = ("perf/step_s", "perf/train_s", "perf/wait_rollout_s", "perf/weight_sync_s", "perf/weight_sync_bytes",
        "rollout/response_len", "rollout/interruptions")


def medians(run: Path) -> dict[str, float]:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    if not trained:
        raise SystemExit(f"run_medians: {run} has no trained step in metrics.jsonl")
    out = {k: round(statistics.median(m[k] for m in trained if k in m), 3) for k in KEYS if any(k in m for m in trained)}
    out["reward_last5"] = round(statistics.mean(m["reward/mean"] for m in trained[-5:]), 3)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    for run in argv:
        print(run, json.dumps(medians(Path(run))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

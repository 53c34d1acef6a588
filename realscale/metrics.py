"""What a run reports: a JSONL line per step (always), TensorBoard and wandb when enabled,
a progress bar, and at the end a PNG plot and a one-screen summary.

The JSONL file is appended and flushed every step, so a crash loses nothing already
logged; a resumed run first drops the records of steps after its checkpoint (they are
redone; see ``realscale.train.checkpoint.truncate_logs``) and then appends, so each step appears once.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

PLOT_KEYS = (("reward/mean", "reward"), ("eval/accuracy", "held-out accuracy"),
             ("rollout/response_len", "response length (tokens)"), ("perf/trained_tokens_per_s", "trained tokens/s"))


class MetricsLogger:
    def __init__(self, run_dir: str, total_steps: int, *, tensorboard: bool = False, wandb: bool = False,
                 wandb_mode: str = "offline", config: dict[str, Any] | None = None, progress: bool = True,
                 start_step: int = 0) -> None:
        self.path = os.path.join(run_dir, "metrics.jsonl")
        os.makedirs(run_dir, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._tb = self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if wandb:
            import wandb as wandb_mod

            self._wandb = wandb_mod.init(project="realscale", dir=run_dir, mode=wandb_mode, config=config or {})
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, values: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in values.items()}}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({"reward": f"{values.get('reward/mean', float('nan')):.3f}",
                                   "acc": f"{values.get('reward/accuracy', float('nan')):.2f}",
                                   "tok/s": f"{values.get('perf/trained_tokens_per_s', 0):.0f}",
                                   "stale": f"{values.get('staleness/max', 0):.0f}"}, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Records by step; several records of one step (the step's metrics, then the final
    evaluation) are merged, later values winning."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line:
                rec = json.loads(line)
                by_step.setdefault(int(rec["step"]), {}).update(rec)
    return [by_step[k] for k in sorted(by_step)]


def plot_run(run_dir: str, staleness_hist: dict[int, int] | None = None) -> str:
    """``run_dir/summary.png``: reward and accuracy, response length, throughput and the
    staleness histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    steps = [r["step"] for r in records]
    ax = axes[0][0]
    ax.plot(steps, [r.get("reward/mean") for r in records], label="reward (train batches)")
    evals = [(0, r["eval/start_greedy"]) for r in records if "eval/start_greedy" in r]
    evals += [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out accuracy (greedy, start/end)")
    ax.set_xlabel("step")
    ax.legend()
    ax.set_title("reward / accuracy")
    for ax, (key, title) in zip((axes[0][1], axes[1][0]), PLOT_KEYS[2:]):
        ax.plot(steps, [r.get(key) for r in records])
        ax.set_title(title)
        ax.set_xlabel("step")
    ax = axes[1][1]
    hist = staleness_hist or {}
    ax.bar([str(k) for k in sorted(hist)], [hist[k] for k in sorted(hist)])
    ax.set_title("staleness of trained groups (versions behind)")
    fig.tight_layout()
    path = os.path.join(run_dir, "summary.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def summary_text(run_dir: str, extra: dict[str, Any]) -> str:
    """The one-screen summary printed at the end of a run."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    lines = [f"run: {run_dir}", f"steps: {len(records)}"]
    for key, value in extra.items():
        lines.append(f"{key}: {value}")
    if records:
        last = records[-1]
        tail = records[-min(5, len(records)):]
        mean = lambda k: sum(r.get(k, 0.0) for r in tail) / len(tail)  # noqa: E731
        lines += [f"reward (last {len(tail)} steps): {mean('reward/mean'):.3f}",
                  f"trained tokens/s (last {len(tail)} steps): {mean('perf/trained_tokens_per_s'):.1f}",
                  f"max staleness: {max(r.get('staleness/max', 0) for r in records):.0f}",
                  f"wall time: {last['time'] - records[0]['time']:.1f} s"]
    lines += [f"metrics: {os.path.join(run_dir, 'metrics.jsonl')}", f"plot: {os.path.join(run_dir, 'summary.png')}"]
    return "\n".join(lines)

"""What a finished (or resumed) run's records must show, read from its run directory:
shared by the one-node and the multi-node Slurm job tests."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable


def trained_steps(run: Path) -> list[int]:
    """The steps ``metrics.jsonl`` records as trained, in order ([] before the first)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if "train/loss" in line]


def assert_each_prompt_trained_once(run: Path, total: int) -> None:
    """Steps 1..total each trained once, and no prompt in two of them (a resume repeated
    or skipped nothing)."""
    by_step: dict[int, list[str]] = {}
    for line in (run / "trained_uids.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_step[rec["step"]] = rec["uids"]
    uids = [u for s in sorted(by_step) for u in by_step[s]]
    assert sorted(by_step) == list(range(1, total + 1)) and len(uids) == len(set(uids)), sorted(by_step)


def hf_hashes(model_dir: Path) -> dict[str, str]:
    """What an embedded server (tp=1, float32) that loaded ``model_dir`` reports on
    ``/realscale/weight_hashes`` (its rank 0)."""
    import torch

    from realscale.serve.weights import RankWeights, read_hf_config

    w = RankWeights.allocate(read_hf_config(str(model_dir)), 1, 0, torch.float32, torch.device("cpu"))
    w.load_dir(str(model_dir))
    return w.hashes()


class HashWatch:
    """Polls a server's ``/realscale/weight_hashes`` while a run goes on, keeping its rank 0
    hashes per weight version; ``find_url`` says which server (None: not known yet). A
    run's servers stop with it, so what they held is read while they live."""

    def __init__(self, find_url: Callable[[], str | None]) -> None:
        self.find_url, self.seen, self.stop = find_url, {}, threading.Event()
        self.url: str | None = None
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            try:
                if self.url is None:
                    self.url = self.find_url()
                if self.url is not None:
                    with urllib.request.urlopen(self.url + "/realscale/weight_hashes", timeout=10) as resp:
                        got = json.loads(resp.read())
                    self.seen[got["weight_version"]] = got["ranks"][0]
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)

    def close(self) -> dict[str, dict[str, str]]:
        self.stop.set()
        self.thread.join(timeout=15)
        return self.seen

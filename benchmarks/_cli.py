"""``python -m realscale ...`` from this checkout, for benchmarks that time whole runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_env() -> dict[str, str]:
    """This process's environment with this checkout first on the import path."""
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_realscale(args: list[str], log_path: str, who: str) -> float:
    """Run ``python -m realscale ARGS`` (this checkout first on the path), output to
    ``log_path``; seconds taken. A failed run ends the benchmark ``who`` with the log's tail."""
    env = checkout_env()
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run([sys.executable, "-m", "realscale", *args], cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            tail = fh.read()[-3000:]
        raise SystemExit(f"{who}: `realscale {' '.join(args)}` failed (exit {proc.returncode}); "
                         f"log {log_path}:\n{tail}")
    return time.perf_counter() - start

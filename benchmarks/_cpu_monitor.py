"""Where a CPU run's cores go: CPU seconds and run-queue wait of each role of a run, sampled.

A local run (``realscale train``) is a tree of processes: the launcher, the generation
server(s) (``realscale serve``), the trainer rank(s) (spawned), and under trainer rank 0
the rollout process (controller, workflow) with its reward workers. :class:`CpuMonitor`
samples, every ``interval`` seconds, each process's CPU time (user + system) and the time
its threads waited on a run queue (``/proc/PID/task/*/schedstat``: runnable, no core free),
summed per role, and the machine's busy CPU seconds (``/proc/stat``), so that what other
jobs on the machine took is the difference. :func:`during` sums them over given wall-clock
windows (the trainer's updates, say), pro-rating the samples that straddle a window edge.

``python benchmarks/_cpu_monitor.py PID OUT.json`` watches a run started some other way
(PID: its ``realscale train`` process) and writes the samples for
``benchmarks/sim_validate.py --from-run``. Linux only (``/proc``); a process that exits between two samples loses its last
interval's CPU (the run's processes live as long as the run).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

ROLES = ("launcher", "server", "trainer", "rollout", "other")


def _threads(pid: int) -> dict[str, tuple[float, float]] | None:
    """(CPU seconds, run-queue seconds) of one process's threads, summed by thread name
    (``comm``: ``python`` for Python's own threads, ``gloo_tcp_loop``, ...)."""
    out: dict[str, tuple[float, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as fh:
                a, b, _ = fh.read().split()
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as fh:
                name = fh.read().strip()
        except (OSError, ValueError):
            continue
        run, wait = out.get(name, (0.0, 0.0))
        out[name] = (run + int(a) / 1e9, wait + int(b) / 1e9)
    return out


def _proc_cpu(pid: int) -> tuple[float, float] | None:
    """(CPU seconds, run-queue seconds) of one process: its threads' schedstat sums."""
    t = _threads(pid)
    if t is None:
        return None
    return sum(v[0] for v in t.values()), sum(v[1] for v in t.values())


def _machine_busy() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat: all but idle, iowait)."""
    with open("/proc/stat", encoding="ascii") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def classify(root: int) -> dict[int, str]:
    """Role of every process under ``root`` (the ``realscale train`` process)."""
    kids, roles = _children(), {root: "launcher"}

    def walk(pid: int, role: str) -> None:
        roles[pid] = role
        for c in kids.get(pid, []):
            walk(c, "rollout" if role in ("trainer", "rollout") else role)

    for c in kids.get(root, []):
        cmd = _cmdline(c)
        if " serve" in cmd:
            walk(c, "server")
        elif "resource_tracker" in cmd:
            walk(c, "other")
        elif "spawn_main" in cmd or "multiprocessing" in cmd:
            walk(c, "trainer")
        else:
            walk(c, "other")
    return roles


class CpuMonitor:
    """Samples the roles of the process tree under ``root`` on a thread until :meth:`stop`."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        self.root, self.interval = root, interval
        self.samples: list[dict[str, Any]] = []  # {"t", "machine", "roles": {role: [cpu, runq]}}
        self._last: dict[int, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-monitor", daemon=True)

    def start(self) -> "CpuMonitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def _sample(self) -> None:
        roles = {r: [0.0, 0.0] for r in ROLES}
        threads: dict[str, list[float]] = {}  # "role/thread name" -> [cpu, runq]
        seen: dict[tuple[int, str], tuple[float, float]] = {}
        for pid, role in classify(self.root).items():
            now = _threads(pid)
            if now is None:
                continue
            for name, v in now.items():
                seen[(pid, name)] = v
                before = self._last.get((pid, name), (0.0, 0.0) if self.samples else v)
                d = (v[0] - before[0], v[1] - before[1])
                roles[role][0] += d[0]
                roles[role][1] += d[1]
                acc = threads.setdefault(f"{role}/{name}", [0.0, 0.0])
                acc[0] += d[0]
                acc[1] += d[1]
        self._last = seen
        self.samples.append({"t": time.time(), "machine": _machine_busy(), "roles": roles, "threads": threads})


def during(samples: list[dict[str, Any]], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """CPU and run-queue seconds per role, and the machine's busy seconds, inside
    ``windows`` (wall-clock ``time.time()`` pairs); a sample's interval is pro-rated."""
    out = {r: [0.0, 0.0] for r in ROLES}
    threads: dict[str, list[float]] = {}
    machine = wall = 0.0
    for a, b in windows:
        wall += b - a
    for prev, cur in zip(samples, samples[1:]):
        t0, t1 = prev["t"], cur["t"]
        if t1 <= t0:
            continue
        overlap = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in windows)
        if overlap <= 0:
            continue
        f = overlap / (t1 - t0)
        machine += f * (cur["machine"] - prev["machine"])
        for r in ROLES:
            out[r][0] += f * cur["roles"][r][0]
            out[r][1] += f * cur["roles"][r][1]
        for name, v in cur.get("threads", {}).items():
            acc = threads.setdefault(name, [0.0, 0.0])
            acc[0] += f * v[0]
            acc[1] += f * v[1]
    ours = sum(v[0] for v in out.values())
    return {"wall_s": wall, "cpu_s": {r: v[0] for r, v in out.items()}, "runq_s": {r: v[1] for r, v in out.items()},
            "threads_cpu_runq_s": {k: [round(v[0], 3), round(v[1], 3)] for k, v in sorted(threads.items())},
            "machine_busy_s": machine, "other_jobs_cpu_s": max(0.0, machine - ours)}


def main() -> None:
    """``python benchmarks/_cpu_monitor.py PID OUT.json``: watch the run whose
    ``realscale train`` process is PID until it exits; write the samples (for
    ``sim_validate.py --from-run RUN_DIR --samples OUT.json``)."""
    import json
    import sys

    pid, out = int(sys.argv[1]), sys.argv[2]
    monitor = CpuMonitor(pid, 1.0).start()
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(2)
    monitor.stop()
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(monitor.samples, fh)


if __name__ == "__main__":
    main()

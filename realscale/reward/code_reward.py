"""The code reward: 1 when the candidate program passes all its tests in the sandbox, else 0.

The program that runs is the candidate code followed by the test code (for HumanEval: the
prompt plus completion, then ``test`` and ``check(entry_point)``); it passes when it exits
with status 0 before the timeout. Runs go through :func:`realscale.reward.sandbox.run_python`
on a bounded thread pool (each thread only waits on its subprocess).
"""

from __future__ import annotations

import asyncio
import collections
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from realscale.reward.result import ERROR, NO_ANSWER, OK, REASONS, TIMEOUT, TOO_LONG, RewardResult
from realscale.reward.sandbox import Isolation, RunResult, SandboxLimits, probe_isolation, run_python

_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.S)


def extract_code(completion: str) -> str:
    """The last fenced code block of a completion, or the completion itself when it has none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeReward:
    """Score programs against tests in the sandbox, ``concurrency`` at a time."""

    def __init__(self, concurrency: int = 4, timeout: float = 10.0, memory_mb: int = 1024,
                 max_chars: int = 100_000, nproc: int = 16) -> None:
        for name, value in (("concurrency", concurrency), ("timeout", timeout), ("memory_mb", memory_mb),
                            ("max_chars", max_chars), ("nproc", nproc)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CodeReward: {name} must be a positive number, got {value!r}")
        self.limits = SandboxLimits(timeout=float(timeout), memory_mb=int(memory_mb), nproc=int(nproc))
        self.max_chars = int(max_chars)
        self.isolation: Isolation = probe_isolation()
        self._executor = ThreadPoolExecutor(max_workers=int(concurrency), thread_name_prefix="code-reward")
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: "object") -> "CodeReward":
        """Build from a :class:`realscale.config.RewardConfig`."""
        return cls(concurrency=cfg.code_concurrency, timeout=cfg.timeout,  # type: ignore[attr-defined]
                   memory_mb=cfg.code_memory_mb)  # type: ignore[attr-defined]

    async def score(self, completion: str, tests: str) -> RewardResult:
        """Score one completion without blocking the event loop."""
        return await asyncio.wrap_future(self._submit(completion, tests))

    def score_batch(self, pairs: list[tuple[str, str]]) -> list[RewardResult]:
        """Score ``(completion, tests)`` pairs concurrently; blocks until all are done."""
        futures = [self._submit(*self._check_pair(i, p)) for i, p in enumerate(pairs)]
        return [f.result() for f in futures]

    def stats(self) -> dict[str, int]:
        """Runs so far by reason, plus ``passed``."""
        with self._lock:
            out = {reason: self._counts.get(reason, 0) for reason in REASONS}
            out["passed"] = self._counts.get("passed", 0)
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "CodeReward":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    @staticmethod
    def _check_pair(i: int, pair: object) -> tuple[str, str]:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"CodeReward: item {i} must be a (completion, tests) tuple, got {type(pair).__name__}")
        for name, value in zip(("completion", "tests"), pair):
            if not isinstance(value, str):
                raise TypeError(f"CodeReward: item {i}: {name} must be str, got {type(value).__name__}")
        return pair  # type: ignore[return-value]

    def _submit(self, completion: str, tests: str) -> Future:
        self._check_pair(0, (completion, tests))
        return self._executor.submit(self._score_sync, completion, tests)

    def _score_sync(self, completion: str, tests: str) -> RewardResult:
        result = self._judge(completion, tests)
        with self._lock:
            self._counts[result.reason] += 1
            if result.value > 0:
                self._counts["passed"] += 1
        return result

    def _judge(self, completion: str, tests: str) -> RewardResult:
        code = extract_code(completion)
        if not code.strip():
            return RewardResult(0.0, NO_ANSWER, "no code in the completion")
        program = code + "\n\n" + tests + "\n"
        if len(program) > self.max_chars:
            return RewardResult(0.0, TOO_LONG, f"program has {len(program)} chars > {self.max_chars}")
        try:
            run = run_python(program, self.limits)
        except Exception as exc:  # noqa: BLE001 - a sandbox failure scores 0 with its reason
            return RewardResult(0.0, ERROR, f"{type(exc).__name__}: {exc}")
        return _verdict(run)


def _verdict(run: RunResult) -> RewardResult:
    if run.timed_out:
        return RewardResult(0.0, TIMEOUT, f"killed after {run.wall_s:.1f} s")
    if run.setup_failed:
        return RewardResult(0.0, ERROR, run.stderr.strip()[:300])
    if run.returncode == 0:
        return RewardResult(1.0, OK, "passed")
    last = (run.stderr.strip().splitlines() or [""])[-1]
    return RewardResult(0.0, OK, f"failed (exit {run.returncode}): {last[:200]}")

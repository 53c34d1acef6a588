"""The math reward: 1 when the completion's final answer equals the reference, else 0.

Checks run in a :class:`~realscale.reward.pool.WatchdogPool` because math-verify (sympy)
can take unbounded time and its timeouts rely on signals, which only work in a process's
main thread. A check that times out, crashes its worker, or gets input over the length
cap scores 0 with the reason counted in :meth:`MathReward.stats`; the run never hangs.

A short completion is first tried in the caller's process: extraction and the plain-number
fast path (:mod:`realscale.reward.math_fast`) are a few regexes over at most
:data:`IN_PROCESS_CHARS` characters, and they settle most RL answers (numbers) with no
sympy. Only what needs math-verify crosses to a worker: the round trip (pickling, a pipe,
a thread hand-off per check) cost more than the check itself, and with a rollout of
hundreds of samples a step on a two-core machine it took CPU from the trainer (the default
recipe's rollout process spent about half its time there, profiled: BENCHMARKS.md).
So the pool itself starts with the first check that needs a worker: a run whose answers
are all plain numbers (the default recipe) never starts its processes, each of which
imports math-verify and sympy (~1 CPU-second apiece, at start-up, where the two-core
machine's CPU decides when the first step comes). A check's timeout starts when its worker
begins it (the pool's progress cell), so the first such check waits for the start-up
without timing out.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from concurrent.futures import Future

from realscale.reward import math_check
from realscale.reward.pool import WatchdogPool, WorkerCrashed, WorkerTimeout
from realscale.reward.result import CRASH, ERROR, REASONS, TIMEOUT, TOO_LONG, RewardResult

# Completions and references up to this many characters are tried in the caller's process
# first (math_check.settle_without_sympy): the regexes' cost is bounded by the length, and
# no timer guards them there.
IN_PROCESS_CHARS = 4096


class MathReward:
    """Score math answers against references in a pool of ``workers`` processes.

    ``timeout``: seconds one check may take (the worker is killed at ``timeout + grace``
    if the check is stuck where the timer cannot interrupt it). ``max_chars``: an extracted
    answer or reference longer than this scores 0 as ``too_long`` before any parsing;
    ``max_completion_chars`` caps the completion itself (it is scanned for the answer).
    ``fast_path=False`` sends every check to math-verify (for comparisons); with it on,
    checks the fast path settles run in the caller's process (``in_process`` in
    :meth:`stats`), the rest in the pool.
    """

    def __init__(self, workers: int = 2, timeout: float = 5.0, max_chars: int = 2000, *,
                 max_completion_chars: int = 200_000, max_batch: int = 64,
                 fast_path: bool = True) -> None:
        for name, value in (("workers", workers), ("timeout", timeout), ("max_chars", max_chars),
                            ("max_completion_chars", max_completion_chars), ("max_batch", max_batch)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MathReward: {name} must be a positive number, got {value!r}")
        self.timeout = float(timeout)
        self.max_chars = int(max_chars)
        self.max_completion_chars = int(max_completion_chars)
        self.fast_path = bool(fast_path)
        self._workers, self._max_batch = int(workers), int(max_batch)
        self._pool: WatchdogPool | None = None  # started by the first check that needs it
        self._pool_lock = threading.Lock()
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: "object") -> "MathReward":
        """Build from a :class:`realscale.config.RewardConfig`."""
        return cls(workers=cfg.workers, timeout=cfg.timeout, max_chars=cfg.max_answer_chars)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- scoring

    async def score(self, completion: str, reference: str) -> RewardResult:
        """Score one completion: settled here when the fast path can (bounded work), else
        off the event loop in the pool (concurrent calls are batched together)."""
        return await self._await(self._submit([(completion, reference)])[0])

    async def score_many_async(self, pairs: list[tuple[str, str]]) -> list[RewardResult]:
        """Score many ``(completion, reference)`` pairs without blocking the event loop."""
        futures = self._submit(pairs)
        results = await asyncio.gather(*(self._await(f) for f in futures))
        return list(results)

    def score_batch(self, pairs: list[tuple[str, str]]) -> list[RewardResult]:
        """Score ``(completion, reference)`` pairs, blocking until all are done."""
        return [self._finish(f) for f in self._submit(pairs)]

    def stats(self) -> dict[str, int]:
        """Checks so far by reason (ok, timeout, crash, too_long, no_answer, error) plus ``correct``
        , ``worker_restarts`` and ``in_process`` (checks settled without the pool)."""
        with self._lock:
            out = {reason: self._counts.get(reason, 0) for reason in REASONS}
            out["correct"] = self._counts.get("correct", 0)
            out["in_process"] = self._counts.get("in_process", 0)
        out["worker_restarts"] = self._pool.restarts if self._pool is not None else 0
        return out

    def close(self) -> None:
        """Stop the worker processes (if any started); later checks raise."""
        with self._pool_lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def started_workers(self) -> list[int]:
        """Process ids of the live workers ([] until a check needed math-verify)."""
        pool = self._pool
        return pool.pids() if pool is not None else []

    def __enter__(self) -> "MathReward":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _submit(self, pairs: list[tuple[str, str]]) -> list[Future]:
        """Validate inputs, answer over-long ones at once, send the rest to the pool."""
        futures: list[Future] = []
        todo: list[tuple[int, tuple[str, str]]] = []
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"MathReward: item {i} must be a (completion, reference) tuple, got {type(pair).__name__}")
            completion, reference = pair
            for name, value in (("completion", completion), ("reference", reference)):
                if not isinstance(value, str):
                    raise TypeError(f"MathReward: item {i}: {name} must be str, got {type(value).__name__}")
            fut: Future = Future()
            futures.append(fut)
            if len(completion) > self.max_completion_chars:
                fut.set_result((0.0, TOO_LONG, f"completion has {len(completion)} chars > {self.max_completion_chars}"))
                continue
            settled = self._settle_here(completion, reference)
            if settled is not None:
                fut.set_result(settled)
            else:
                todo.append((i, (completion, reference)))
        if todo:
            for (i, _), pool_fut in zip(todo, self._workers_pool().submit_many([pair for _, pair in todo])):
                futures[i] = pool_fut
        return futures

    def _workers_pool(self) -> WatchdogPool:
        """The worker pool, started on first use."""
        with self._pool_lock:
            if self._closed:
                raise RuntimeError("MathReward is closed")
            if self._pool is None:
                self._pool = WatchdogPool(math_check.check, self._workers, self.timeout + max(1.0, 0.5 * self.timeout),
                                          init=math_check.init_worker,
                                          init_args=(self.timeout, self.max_chars, self.fast_path),
                                          max_batch=self._max_batch)
            return self._pool

    def _settle_here(self, completion: str, reference: str) -> math_check.Outcome | None:
        """The outcome without the pool when the fast path settles a short check, else None."""
        if not self.fast_path or len(completion) > IN_PROCESS_CHARS or len(reference) > IN_PROCESS_CHARS:
            return None
        outcome = math_check.settle_without_sympy(completion, reference, self.max_chars)
        if outcome is not None:
            with self._lock:
                self._counts["in_process"] += 1
        return outcome

    def _finish(self, fut: Future) -> RewardResult:
        """Turn a pool future into a RewardResult and count its reason."""
        try:
            value, reason, detail = fut.result()
        except WorkerTimeout as exc:
            value, reason, detail = 0.0, TIMEOUT, str(exc)
        except WorkerCrashed as exc:
            value, reason, detail = 0.0, CRASH, str(exc)
        except Exception as exc:  # noqa: BLE001 - e.g. the pool closed under us: score 0, say why
            value, reason, detail = 0.0, ERROR, f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._counts[reason] += 1
            if value > 0:
                self._counts["correct"] += 1
        return RewardResult(value, reason, detail)

    async def _await(self, fut: Future) -> RewardResult:
        if fut.done():  # settled in this process: no hop through the loop's self-pipe
            return self._finish(fut)
        try:
            await asyncio.wrap_future(fut)
        except Exception:  # noqa: BLE001 - _finish reads the exception and turns it into a reason
            pass
        return self._finish(fut)

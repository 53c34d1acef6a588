"""The code reward: 1 when the candidate passes all its tests, judged outside the sandbox.

The completion's last fenced code block (or the whole completion) is the candidate
program; the sample's tests take one of three forms (:mod:`realscale.reward.code_tests`):
stdin/stdout cases compared by this process, function calls whose plain-data return values
this process compares, or trusted test code (HumanEval's ``check``) run by a judge process
that calls into the candidate. The candidate's exit status, its objects and its view of the
tests never decide the score. Runs go through :mod:`realscale.reward.sandbox` on a bounded
thread pool (each thread only waits on its run).

A sandbox missing a layer of isolation refuses the run (0, reason ``sandbox``) unless
``allow_weaker`` (``reward.code_sandbox_allow_weaker``) is set: then the run goes ahead,
a warning names the missing layers once, and :meth:`CodeReward.stats` counts the weakened
runs (``sandbox_weakened``). A program never runs as root either way.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from realscale.reward import plain
from realscale.reward.code_tests import (CallTests, CodeTests, StdioTests, answer_matches, parse_tests,
                                         stdout_matches)
from realscale.reward.result import ERROR, NO_ANSWER, OK, REASONS, SANDBOX, TIMEOUT, TOO_LONG, RewardResult
from realscale.reward.sandbox import (UID_BASE, Isolation, RunResult, Sandbox, SandboxLimits, SandboxRefused,
                                      ServerOutcome, shared_sandbox)

log = logging.getLogger(__name__)
_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.S)


def extract_code(completion: str) -> str:
    """The last fenced code block of a completion, or the completion itself when it has none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class ScoringPool:
    """``(completion, tests)`` pairs scored on a bounded thread pool, verdicts counted.

    A subclass says how one pair is scored (:meth:`_judge`, run on a pool thread) and which
    counters it keeps besides the reasons and ``passed`` (:attr:`EXTRA`)."""

    EXTRA: tuple[str, ...] = ()

    def __init__(self, concurrency: int, thread_name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=int(concurrency), thread_name_prefix=thread_name)
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    async def score(self, completion: str, tests: object) -> RewardResult:
        """Score one completion without blocking the event loop."""
        return await asyncio.wrap_future(self._submit(completion, tests))

    def score_batch(self, pairs: list[tuple[str, object]]) -> list[RewardResult]:
        """Score ``(completion, tests)`` pairs concurrently; blocks until all are done."""
        futures = [self._submit(*self._check_pair(i, p)) for i, p in enumerate(pairs)]
        return [f.result() for f in futures]

    def stats(self) -> dict[str, int]:
        """Runs so far by reason, plus ``passed`` and the :attr:`EXTRA` counters."""
        with self._lock:
            out = {reason: self._counts.get(reason, 0) for reason in REASONS}
            for name in ("passed", *self.EXTRA):
                out[name] = self._counts.get(name, 0)
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "ScoringPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _judge(self, completion: str, tests: object) -> RewardResult:
        raise NotImplementedError

    def _count(self, name: str) -> int:
        """Add one to counter ``name``; its new value."""
        with self._lock:
            self._counts[name] += 1
            return self._counts[name]

    @staticmethod
    def _check_pair(i: int, pair: object) -> tuple[str, object]:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"CodeReward: item {i} must be a (completion, tests) tuple, got {type(pair).__name__}")
        if not isinstance(pair[0], str):
            raise TypeError(f"CodeReward: item {i}: completion must be str, got {type(pair[0]).__name__}")
        if not isinstance(pair[1], (str, list, dict)):
            raise TypeError(f"CodeReward: item {i}: tests must be str, list or dict, got {type(pair[1]).__name__}")
        return pair  # type: ignore[return-value]

    def _submit(self, completion: str, tests: object) -> Future:
        self._check_pair(0, (completion, tests))
        return self._executor.submit(self._score_sync, completion, tests)

    def _score_sync(self, completion: str, tests: object) -> RewardResult:
        result = self._judge(completion, tests)
        self._count(result.reason)
        if result.value > 0:
            self._count("passed")
        return result


class CodeReward(ScoringPool):
    """Score programs against tests in the sandbox, ``concurrency`` at a time."""

    EXTRA = ("sandbox_weakened",)

    def __init__(self, concurrency: int = 4, timeout: float = 10.0, memory_mb: int = 1024,
                 max_chars: int = 100_000, nproc: int = 16, disk_mb: int = 64, allow_weaker: bool = False,
                 python: str | None = None, uid_base: int = UID_BASE) -> None:
        for name, value in (("concurrency", concurrency), ("timeout", timeout), ("memory_mb", memory_mb),
                            ("max_chars", max_chars), ("nproc", nproc), ("disk_mb", disk_mb)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CodeReward: {name} must be a positive number, got {value!r}")
        self.limits = SandboxLimits(timeout=float(timeout), memory_mb=int(memory_mb), nproc=int(nproc),
                                    disk_mb=int(disk_mb))
        self.max_chars = int(max_chars)
        self.allow_weaker = bool(allow_weaker)
        self.sandbox: Sandbox = shared_sandbox(python or None, uid_base)
        self.isolation: Isolation = self.sandbox.probe()
        super().__init__(concurrency, "code-reward")

    @classmethod
    def from_config(cls, cfg: "object") -> "CodeReward":
        """Build from a :class:`realscale.config.RewardConfig`."""
        return cls(concurrency=cfg.code_concurrency, timeout=cfg.timeout,  # type: ignore[attr-defined]
                   memory_mb=cfg.code_memory_mb, disk_mb=cfg.code_disk_mb,  # type: ignore[attr-defined]
                   allow_weaker=cfg.code_sandbox_allow_weaker,  # type: ignore[attr-defined]
                   python=cfg.code_python or None, uid_base=cfg.code_uid_base)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- internals

    def _layers(self) -> dict[str, bool]:
        layers = self.sandbox.layers_for(self.allow_weaker)  # SandboxRefused when not allowed
        if not self.isolation.full:
            if self._count("sandbox_weakened") == 1:  # warn once
                log.warning("code reward: running WITHOUT a full sandbox (reward.code_sandbox_allow_weaker=true): "
                            "missing %s", self.isolation.describe())
        return layers

    def _judge(self, completion: str, tests: object) -> RewardResult:
        code = extract_code(completion)
        if not code.strip():
            return RewardResult(0.0, NO_ANSWER, "no code in the completion")
        if len(code) > self.max_chars:
            return RewardResult(0.0, TOO_LONG, f"program has {len(code)} chars > {self.max_chars}")
        try:
            form = parse_tests(tests)
        except ValueError as exc:
            return RewardResult(0.0, ERROR, str(exc)[:300])
        try:
            layers = self._layers()
            return self._run(code, form, layers)
        except SandboxRefused as exc:
            return RewardResult(0.0, SANDBOX, str(exc)[:300])
        except Exception as exc:  # noqa: BLE001 - a sandbox failure scores 0 with its reason
            return RewardResult(0.0, ERROR, f"{type(exc).__name__}: {exc}"[:300])

    def _run(self, code: str, form: CodeTests, layers: dict[str, bool]) -> RewardResult:
        if isinstance(form, StdioTests):
            return self._stdio(code, form, layers)
        if isinstance(form, CallTests):
            return self._calls(code, form, layers)
        outcome = self.sandbox.run_check(code, form.test, form.entry_point, form.prelude, form.names, self.limits,
                                         layers)
        return _check_verdict(outcome)

    def _stdio(self, code: str, form: StdioTests, layers: dict[str, bool]) -> RewardResult:
        def judge(i: int, run: RunResult) -> bool:
            return _case_passed(run) and stdout_matches(run.stdout, form.outputs[i])

        runs = self.sandbox.run_stdio(code, form.inputs, self.limits, layers, judge)
        for i, run in enumerate(runs):
            if not judge(i, run):
                return _process_verdict(f"case {i}", run) or RewardResult(0.0, OK, f"case {i}: wrong output")
        if len(runs) < len(form.inputs):
            return RewardResult(0.0, ERROR, f"the sandbox ran {len(runs)} of {len(form.inputs)} cases")
        return RewardResult(1.0, OK, f"passed {len(runs)} cases")

    def _calls(self, code: str, form: CallTests, layers: dict[str, bool]) -> RewardResult:
        failures: list[str] = []

        def judge(i: int, line: str | None) -> bool:
            why = _answer_failure(line, form.expected[i], form.lenient)
            if why:
                failures.append(f"call {i}: {why}")
            return not why

        calls = [(plain.to_json(args), plain.to_json(kwargs)) for args, kwargs in form.calls]
        outcome = self.sandbox.run_calls(code, form.fn, calls, self.limits, layers, judge)
        run = outcome.run
        if run.setup_failed:
            return RewardResult(0.0, SANDBOX, f"sandbox set-up failed: {run.setup_error}"[:300])
        if not failures and not outcome.load_error and len(outcome.answers) == len(calls):
            return RewardResult(1.0, OK, f"passed {len(calls)} calls")
        why = (f"to load: {outcome.load_error}" if outcome.load_error else failures[0] if failures
               else "the program stopped answering")
        if run.timed_out and (outcome.load_error or why.endswith("no answer")):
            return RewardResult(0.0, TIMEOUT, f"{why}: killed after {run.wall_s:.1f} s"[:300])
        return RewardResult(0.0, OK, f"failed {why}"[:300])


def _case_passed(run: RunResult) -> bool:
    return run.returncode == 0 and not run.timed_out and not run.stdout_truncated and not run.setup_failed


def _process_verdict(where: str, run: RunResult) -> RewardResult | None:
    """The 0 a run's end explains (sandbox failure, timeout, crash), or None when it ended normally."""
    if run.setup_failed:
        return RewardResult(0.0, SANDBOX, f"{where}: sandbox set-up failed: {run.setup_error}"[:300])
    if run.timed_out:
        return RewardResult(0.0, TIMEOUT, f"{where}: killed after {run.wall_s:.1f} s")
    if run.returncode not in (0, None) and run.returncode < 0:
        last = (run.stderr.strip().splitlines() or [""])[-1]
        return RewardResult(0.0, OK, f"{where}: killed by signal {-run.returncode} {last[:200]}")
    if run.returncode not in (0, None):
        last = (run.stderr.strip().splitlines() or [""])[-1]
        return RewardResult(0.0, OK, f"{where}: failed (exit {run.returncode}): {last[:200]}")
    return None


def _answer_failure(line: str | None, expected: object, lenient: bool) -> str:
    """Why one call's raw answer line is not the expected value ("" when it is)."""
    if line is None:
        return "no answer"
    try:
        answer = json.loads(line)
        if not isinstance(answer, dict):
            return "malformed answer"
        if "ok" not in answer:
            return f"raised {answer.get('raise')}: {str(answer.get('msg'))[:200]}"
        value = plain.from_json(answer["ok"])
    except (ValueError, RecursionError) as exc:
        return f"malformed answer ({str(exc)[:100]})"
    return "" if answer_matches(value, expected, lenient) else "wrong answer"


def _check_verdict(outcome: ServerOutcome) -> RewardResult:
    verdict = outcome.verdict or {}
    if verdict.get("passed"):
        return RewardResult(1.0, OK, "passed")
    if outcome.run.setup_failed or outcome.run.timed_out:
        return _process_verdict("program", outcome.run)  # type: ignore[return-value]
    detail = str(verdict.get("detail", "failed"))
    if outcome.load_error:
        detail = f"failed: program did not load: {outcome.load_error}"
    return RewardResult(0.0, OK, detail[:300])

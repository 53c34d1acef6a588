"""Reward functions for rollouts, and the calls that keep them off the event loop.

A reward function is ``fn(prompt, completion, sample) -> float | RewardResult``, sync or
async. :func:`call_reward` runs it without blocking the rollout
event loop (awaiting an async one, a sync one in a thread) and under a timeout: a reward
that hangs scores 0 with reason ``timeout`` and the episode goes on. A sync function that
hangs keeps its thread busy (Python cannot kill a thread), so each sync call runs in its
own daemon thread: a hung one neither starves a shared pool nor blocks interpreter exit
(a ThreadPoolExecutor joins its threads at exit).

:func:`reward_fn_for` picks the checker a sample needs: the reasoning-gym task's own
scorer for ``gym:`` samples, :class:`~realscale.reward.CodeReward` for samples with tests
(when ``reward.kind`` is ``code`` or the sample has no answer), else
:class:`~realscale.reward.MathReward` against ``sample.answer``. The pools behind them are
built once per configuration and shared (:func:`close_reward_pools` stops them).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Union

from realscale.data.dataset import PromptSample, score
from realscale.reward import CodeReward, MathReward
from realscale.reward.judge import JudgeClient
from realscale.reward.math_extract import extract_answer
from realscale.reward.result import ERROR, OK, TIMEOUT, RewardResult

if TYPE_CHECKING:
    from realscale.config import RewardConfig

log = logging.getLogger(__name__)

RewardValue = Union[float, RewardResult]
RewardFn = Callable[[str, str, PromptSample], Union[RewardValue, Awaitable[RewardValue]]]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def as_result(value: Any) -> RewardResult:
    """A reward function's return value as a :class:`RewardResult` (numbers count as ``ok``)."""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return RewardResult(float(value), OK)
    raise TypeError(f"a reward function must return a float or RewardResult, got {type(value).__name__}")


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run ``fn(*args)`` in a new daemon thread; the future resolves on the running loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():  # cancelled by a timeout meanwhile: drop the late result
            fut.set_result(value) if ok else fut.set_exception(value)

    def target() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed while fn ran
            pass

    threading.Thread(target=target, name="rollout-reward", daemon=True).start()
    return fut


async def call_reward(fn: RewardFn, prompt: str, completion: str, sample: PromptSample, *,
                      timeout: float) -> RewardResult:
    """Score one completion off the loop; a timeout or an exception scores 0 with its reason."""
    async def run() -> Any:
        if _is_async(fn):
            return await fn(prompt, completion, sample)
        value = await in_daemon_thread(fn, prompt, completion, sample)
        return await value if inspect.isawaitable(value) else value

    try:
        return as_result(await asyncio.wait_for(run(), timeout))
    except asyncio.TimeoutError:
        log.warning("reward for %s timed out after %.1f s; scoring 0", sample.uid or "?", timeout)
        return RewardResult(0.0, TIMEOUT, f"reward took longer than {timeout} s")
    except Exception as exc:  # noqa: BLE001 - a broken checker must not kill the rollout
        log.warning("reward for %s failed (%r); scoring 0", sample.uid or "?", exc)
        return RewardResult(0.0, ERROR, f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- checkers


def gym_answer(completion: str) -> str:
    """The answer part of a completion for a reasoning-gym checker: the last
    ``<answer>...</answer>`` (the gym's convention), else the math extractor's answer,
    else the whole stripped completion."""
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()

    found = extract_answer(completion)
    return found[0] if found else completion.strip()


def gym_reward(prompt: str, completion: str, sample: PromptSample) -> float:
    """The gym task's own score (sync: :func:`call_reward` runs it in a thread)."""

    return score(gym_answer(completion), sample)


_POOLS: dict[tuple[Any, ...], Any] = {}
_POOLS_LOCK = threading.Lock()


def _pool(kind: str, cfg: RewardConfig) -> Any:
    """The shared MathReward/CodeReward (or JudgeClient) for this configuration (built on first use)."""
    if kind == "math":
        key: tuple[Any, ...] = ("math", cfg.workers, cfg.timeout, cfg.max_answer_chars)
    elif cfg.code_judge_url:
        key = ("code", "judge", cfg.code_judge_url, cfg.code_concurrency, cfg.timeout)
    else:
        key = ("code", cfg.code_concurrency, cfg.timeout, cfg.code_memory_mb, cfg.code_disk_mb,
               cfg.code_sandbox_allow_weaker, cfg.code_python, cfg.code_uid_base)
    with _POOLS_LOCK:
        if key not in _POOLS:
            build = MathReward if kind == "math" else JudgeClient if cfg.code_judge_url else CodeReward
            _POOLS[key] = build.from_config(cfg)
        return _POOLS[key]


def reward_pool_stats() -> dict[str, float]:
    """Counters of the shared code reward pools (runs by reason, ``sandbox_weakened``,
    ``judge_unreachable``), for the step log."""
    with _POOLS_LOCK:
        pools = [p for key, p in _POOLS.items() if key[0] == "code"]
    out: dict[str, float] = {}
    for pool in pools:
        for name, n in pool.stats().items():
            out[f"reward_pool/{name}"] = out.get(f"reward_pool/{name}", 0.0) + n
    return out


def close_reward_pools() -> None:
    """Stop every shared reward pool (their processes and threads)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


def reward_fn_for(cfg: RewardConfig, sample: PromptSample) -> RewardFn:
    """The reward function for ``sample`` under ``cfg`` (a :class:`realscale.config.RewardConfig`)."""
    if "gym_task" in sample.metadata:
        return gym_reward
    has_tests = sample.tests not in (None, "", [], {})
    if has_tests and (cfg.kind == "code" or sample.answer is None):
        pool = _pool("code", cfg)
        tests = sample.tests  # any form CodeReward knows (realscale.reward.code_tests)

        async def code(prompt: str, completion: str, s: PromptSample) -> RewardResult:
            return await pool.score(completion, tests)

        return code
    if sample.answer is None:
        raise ValueError(f"sample {sample.uid or '?'} has neither an answer nor tests to score against")
    pool = _pool("math", cfg)
    answer = sample.answer

    async def math(prompt: str, completion: str, s: PromptSample) -> RewardResult:
        return await pool.score(completion, answer)

    return math


def routed_reward(cfg: RewardConfig) -> RewardFn:
    """One reward function for a whole dataset: dispatches each sample with :func:`reward_fn_for`."""
    async def route(prompt: str, completion: str, sample: PromptSample) -> RewardResult:
        fn = reward_fn_for(cfg, sample)
        if _is_async(fn):
            return as_result(await fn(prompt, completion, sample))
        return as_result(await in_daemon_thread(fn, prompt, completion, sample))

    return route

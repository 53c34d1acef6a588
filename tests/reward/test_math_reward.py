"""MathReward end to end: accuracy on the labelled cases, timeouts, crashes, caps, async use."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest

from realscale.reward.math_reward import MathReward
from realscale.reward.result import RewardResult

CASES = os.path.join(os.path.dirname(__file__), "data", "math_cases.jsonl")


@pytest.fixture(scope="module")
def reward():
    # A generous timeout: on a loaded machine a symbolic check can take seconds.
    r = MathReward(workers=2, timeout=10.0, max_chars=2000)
    yield r
    r.close()


@pytest.fixture(scope="module")
def quick():
    """A short timeout, for the tests that make checks run past it."""
    r = MathReward(workers=1, timeout=1.5)
    yield r
    r.close()


def _cases() -> list[dict]:
    with open(CASES, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_case_file_is_big_and_balanced() -> None:
    cases = _cases()
    kinds = {c["kind"] for c in cases}
    assert len(cases) >= 300
    assert sum(c["equal"] for c in cases) > 300 and sum(not c["equal"] for c in cases) > 200
    assert {"fraction", "percent", "interval", "set", "matrix", "symbolic"} <= kinds
    assert sum(c["source"].startswith("gsm8k:") for c in cases) >= 500


def test_accuracy_on_labelled_cases_is_at_least_99_percent(reward: MathReward) -> None:
    cases = _cases()
    results = reward.score_batch([(c["completion"], c["reference"]) for c in cases])
    wrong = [(c["completion"][-60:], c["reference"], c["equal"], r) for c, r in zip(cases, results)
             if (r.value == 1.0) != c["equal"]]
    assert len(wrong) <= 0.01 * len(cases), wrong
    assert all(r.reason in ("ok", "no_answer") for r in results)


def test_timeout_scores_zero_with_reason_and_pool_goes_on(quick: MathReward) -> None:
    reward = quick
    start = time.monotonic()
    slow, fine = reward.score_batch([(r"\boxed{(10^{6})!}", "1"), ("The answer is 3.", "3")])
    assert time.monotonic() - start < 10
    assert slow == RewardResult(0.0, "timeout", slow.detail)
    assert fine.value == 1.0 and fine.reason == "ok"
    assert reward.stats()["timeout"] >= 1


def test_killed_worker_gives_crash_and_is_replaced(quick: MathReward) -> None:
    reward = quick
    restarts = reward.stats()["worker_restarts"]
    result: list[RewardResult] = []
    t = threading.Thread(target=lambda: result.extend(reward.score_batch([(r"\boxed{(10^{6})!}", "1")])))
    t.start()
    time.sleep(0.7)  # the check is now running in the worker (it would take > 1.5 s)
    for pid in reward.started_workers():
        os.kill(pid, signal.SIGKILL)
    t.join(timeout=30)
    assert result and result[0].value == 0.0 and result[0].reason in ("crash", "timeout")
    assert reward.stats()["worker_restarts"] > restarts
    again = reward.score_batch([("so \\boxed{\\frac{1}{2}}", "0.5")] * 4)
    assert [r.value for r in again] == [1.0] * 4


def test_length_caps_and_missing_answers(reward: MathReward) -> None:
    long_answer = "\\boxed{" + "1" * 2500 + "}"
    too_long, no_answer, long_ref = reward.score_batch([
        (long_answer, "1"), ("I have no idea.", "5"), ("\\boxed{1}", "1" * 2500)])
    assert (too_long.value, too_long.reason) == (0.0, "too_long")
    assert (no_answer.value, no_answer.reason) == (0.0, "no_answer")
    assert long_ref.reason == "too_long"


def test_async_score_runs_off_the_event_loop(reward: MathReward) -> None:
    async def main() -> tuple[list[RewardResult], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        tick_task = asyncio.create_task(ticker())
        results = await asyncio.gather(*(reward.score(f"The answer is {i}.", str(i % 7)) for i in range(200)))
        tick_task.cancel()
        return list(results), ticks

    results, ticks = asyncio.run(main())
    assert [r.value for r in results] == [float(i == i % 7) for i in range(200)]
    assert ticks > 0


def test_bad_inputs_are_named(reward: MathReward) -> None:
    with pytest.raises(TypeError, match="item 0: reference must be str"):
        reward.score_batch([("1", 1)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="item 1 must be a"):
        reward.score_batch([("1", "1"), "1"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeout"):
        MathReward(timeout=0)


def test_stats_count_every_reason(reward: MathReward) -> None:
    before = reward.stats()
    reward.score_batch([("\\boxed{2}", "2"), ("\\boxed{3}", "2"), ("nothing", "2")])
    after = reward.stats()
    assert after["ok"] - before["ok"] == 2
    assert after["no_answer"] - before["no_answer"] == 1
    assert after["correct"] - before["correct"] == 1


def test_plain_number_checks_settle_in_process_with_the_workers_verdicts(reward: MathReward,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Checks the fast path settles never reach the pool (most of the labelled cases, every
    GSM8K-style number), and their outcomes are exactly what a worker returns for them."""
    import realscale.reward.math_reward as math_reward

    pairs = [(c["completion"], c["reference"]) for c in _cases()]
    before = reward.stats()["in_process"]
    here = reward.score_batch(pairs)
    settled = reward.stats()["in_process"] - before
    assert settled > 0.5 * len(pairs)
    assert reward.score_batch([("so the total is 42", "#### 42")])[0].value == 1.0
    assert reward.stats()["in_process"] == before + settled + 1
    monkeypatch.setattr(math_reward, "IN_PROCESS_CHARS", 0)  # every check through a worker
    in_workers = reward.score_batch(pairs)
    assert reward.stats()["in_process"] == before + settled + 1
    assert [(r.value, r.reason, r.detail) for r in here] == [(r.value, r.reason, r.detail) for r in in_workers]
    symbolic = reward.score_batch([("the answer is $\\sqrt{2}/2$", "\\frac{1}{\\sqrt{2}}")])[0]
    assert symbolic.value == 1.0 and symbolic.detail.endswith("math-verify")  # sympy's work stays in a worker


def test_the_pool_starts_with_the_first_check_that_needs_a_worker() -> None:
    """Plain-number checks start no process (the default recipe never needs one); the first
    symbolic check starts the workers, waits for their start-up without timing out (its
    timer runs from when a worker begins it) and gets math-verify's verdict."""
    import psutil

    me = psutil.Process()
    before = {c.pid for c in me.children()}
    r = MathReward(workers=1, timeout=1.5)
    try:
        plain = r.score_batch([("so the total is 42", "#### 42"), ("(3+9=12,2+1+1=4)42", "42")] * 20)
        assert [x.value for x in plain] == [1.0] * 40
        assert r.started_workers() == [] and {c.pid for c in me.children()} - before == set()
        symbolic = r.score_batch([("the answer is $\\sqrt{2}/2$", "\\frac{1}{\\sqrt{2}}")])[0]
        assert symbolic.value == 1.0 and symbolic.detail.endswith("math-verify")
        assert len(r.started_workers()) == 1 and r.stats()["timeout"] == 0
    finally:
        r.close()
    with pytest.raises(RuntimeError, match="closed"):  # a worker is needed, none is started again
        r.score_batch([("the answer is $\\sqrt{2}/2$", "\\frac{1}{\\sqrt{2}}")])

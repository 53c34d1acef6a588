"""Generation time limits: the policy (budget and measured decode rate, pauses, batch
limit) on a controlled clock, and a real embedded server slowed on purpose: a request past
its limit is aborted on its server, its partial output kept and the rest resent, giving
the same greedy answer as an unhurried request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from realscale.inference.timeouts import FLOOR_S, MIN_MEASURED_TOKENS, OFF, RequestTimeouts


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_fixed_off_and_auto_limits() -> None:
    assert RequestTimeouts(7.5).limit(10_000) == 7.5
    assert RequestTimeouts(OFF).limit(10) is None
    auto = RequestTimeouts(0.0, slack=4.0)
    assert auto.limit(100) is None  # nothing measured yet: no guess
    auto.observe(50, 5.0)  # 10 tok/s
    auto.observe(MIN_MEASURED_TOKENS - 1, 100.0)  # too short to say anything about decode speed
    auto.observe(200, 10.0)  # 20 tok/s
    assert auto.decode_rate == 10.0  # the slowest recent request
    assert auto.limit(27_648) == pytest.approx(FLOOR_S + 4.0 * 27_648 / 10.0)  # a 27k-token answer gets ~3 h
    assert auto.limit(24) == pytest.approx(FLOOR_S + 9.6)
    with pytest.raises(ValueError):
        RequestTimeouts(-5.0)
    with pytest.raises(ValueError):
        RequestTimeouts(0.0, slack=1.0)


def test_paused_time_does_not_count() -> None:
    clock = Clock()
    tm = RequestTimeouts(0.0, clock=clock)
    mark = tm.mark()
    clock.t += 10
    tm.pause()
    clock.t += 100  # a weight update holding the request
    assert tm.active_since(mark) == pytest.approx(10)
    tm.resume()
    clock.t += 5
    assert tm.active_since(mark) == pytest.approx(15)


def test_batch_limit_counts_waves_of_full_length_requests() -> None:
    tm = RequestTimeouts(0.0, slack=2.0)
    assert tm.batch_limit(256, answers=64, slots=32) is None
    tm.observe(100, 10.0)  # 10 tok/s -> one request of 256 tokens: 30 + 51.2 s
    one = FLOOR_S + 2.0 * 256 / 10.0
    assert tm.batch_limit(256, answers=64, slots=32) == pytest.approx(3 * one)  # 2 waves + 1
    assert tm.batch_limit(256, answers=8, slots=32) == pytest.approx(2 * one)
    assert RequestTimeouts(OFF).batch_limit(256, 64, 32) is None


# ----------------------------------------------------------------------------- a slowed server


def slow_down(server: Any, seconds_per_step: float) -> None:
    """Test hook: every forward pass of the server's engine (prefill or one decode step)
    sleeps first. The server stays real: same scheduler, HTTP API, abort path."""
    runner = server.engine.runner
    forward = runner.forward

    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds_per_step)
        return forward(*args, **kwargs)

    runner.forward = slowed


@pytest.fixture
def slow_server():
    from realscale.serve.server import EmbeddedServer, start_in_thread

    server = EmbeddedServer("tiny-qwen2", max_running=8, context_length=256)
    aborted: list[str] = []
    abort = server.engine.abort

    def counting_abort(rid: Any, message: str = "aborted") -> int:
        if rid is not None:
            aborted.append(rid)
        return abort(rid, message)

    server.engine.abort = counting_abort
    url, stop = start_in_thread(server)
    yield url, server, aborted
    stop()


def test_request_past_its_limit_is_aborted_and_its_partial_output_kept(slow_server) -> None:
    from realscale.inference.client import InferenceClient

    url, server, aborted = slow_server
    prompt = [1, 2, 3, 4, 5]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}

    async def run(timeout: float) -> Any:
        async with InferenceClient([url], request_timeout=timeout) as client:
            return await client.generate(prompt, dict(params))

    reference = asyncio.run(run(-1))  # no limit, full speed
    assert reference.num_timeouts == 0 and len(reference.output_ids) == 24
    # 24 forward passes of >= 0.2 s each take >= 4.8 s, so a 1 s limit must expire at least
    # 4 times whatever the machine's load (load only makes the server slower).
    slow_down(server, 0.2)
    got = asyncio.run(run(1.0))
    assert got.num_timeouts >= 4 and len(aborted) == got.num_timeouts
    assert all(rid.startswith(aborted[0].split("-")[0]) for rid in aborted)  # the request's own rid, each time
    assert got.output_ids == reference.output_ids  # the partial outputs were kept and continued
    assert len(got.output_logprobs) == len(got.output_versions) == 24
    assert got.finish_reason["type"] == "length"


def test_auto_limit_follows_the_measured_rate(slow_server) -> None:
    from realscale.inference.client import InferenceClient

    url, _, aborted = slow_server

    async def run() -> Any:
        async with InferenceClient([url], request_timeout=0.0, timeout_slack=3.0) as client:
            assert client.timeouts.limit(24) is None
            res = await client.generate([1, 2, 3], {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})
            return res, client.timeouts.decode_rate, client.timeouts.limit(24)

    res, rate, limit = asyncio.run(run())
    assert res.num_timeouts == 0 and not aborted
    assert rate is not None and rate > 0
    assert limit == pytest.approx(FLOOR_S + 3.0 * 24 / rate)

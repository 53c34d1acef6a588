"""WatchdogPool: results in order, hung workers killed and replaced, dead workers replaced."""

from __future__ import annotations

import time

import pytest
from pool_targets import square_or_misbehave

from realscale.reward.pool import WatchdogPool, WorkerCrashed, WorkerTimeout


@pytest.fixture(scope="module")
def pool():
    p = WatchdogPool(square_or_misbehave, workers=2, hard_timeout=1.0, max_batch=8)
    yield p
    p.close()


def test_results_come_back_for_every_item(pool: WatchdogPool) -> None:
    futures = pool.submit_many([("ok", i) for i in range(200)])
    assert [f.result(timeout=60) for f in futures] == [i * i for i in range(200)]


def test_hung_item_times_out_and_the_rest_of_its_batch_still_runs(pool: WatchdogPool) -> None:
    restarts = pool.restarts
    items = [("ok", 1), ("ok", 2), ("hang", 60), ("ok", 3), ("ok", 4)]
    start = time.monotonic()
    futures = pool.submit_many(items)
    with pytest.raises(WorkerTimeout):
        futures[2].result(timeout=30)
    others = [futures[i].result(timeout=30) for i in (0, 1, 3, 4)]
    assert others == [1, 4, 9, 16]
    assert time.monotonic() - start < 20  # killed at ~1 s, not after the 60 s sleep
    assert pool.restarts == restarts + 1


def test_dead_worker_fails_its_item_and_is_replaced(pool: WatchdogPool) -> None:
    futures = pool.submit_many([("ok", 5), ("die", 3), ("ok", 6)])
    with pytest.raises(WorkerCrashed):
        futures[1].result(timeout=30)
    assert futures[0].result(timeout=30) == 25
    assert futures[2].result(timeout=30) == 36
    assert [f.result(timeout=60) for f in pool.submit_many([("ok", 7)] * 10)] == [49] * 10


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="workers"):
        WatchdogPool(square_or_misbehave, workers=0, hard_timeout=1.0)
    with pytest.raises(ValueError, match="hard_timeout"):
        WatchdogPool(square_or_misbehave, workers=1, hard_timeout=0)


def test_closed_pool_refuses_work() -> None:
    p = WatchdogPool(square_or_misbehave, workers=1, hard_timeout=1.0)
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(("ok", 1))


def test_workers_start_as_work_needs_them() -> None:
    """No process before the first item; items that come one at a time run on one worker;
    a second starts once two batches are in hand at once (a hung item holds the first)."""
    p = WatchdogPool(square_or_misbehave, workers=2, hard_timeout=3.0, max_batch=8)
    try:
        assert p.pids() == []
        for i in range(6):
            assert p.submit(("ok", i)).result(timeout=60) == i * i
        assert len(p.pids()) == 1
        held = p.submit(("hang", 2))
        time.sleep(0.5)  # the started worker is now busy with it
        assert p.submit(("ok", 9)).result(timeout=60) == 81
        assert len(p.pids()) == 2
        held.result(timeout=30)
    finally:
        p.close()

"""The staleness rule, against hand-computed values and a randomised trainer/rollout race."""

from __future__ import annotations

import random

import pytest

from realscale.rollout.staleness import StalenessManager


def _submit(m: StalenessManager, n: int) -> None:
    for _ in range(n):
        m.on_submit()


def test_capacity_hand_computed() -> None:
    m = StalenessManager(batch_size=4, max_staleness=2, max_concurrent=10)
    assert m.capacity(0) == 10  # min(10 - 0, 3*4 - 0)
    _submit(m, 10)
    assert m.capacity(0) == 0  # min(0, 12 - 10)
    for _ in range(6):
        m.on_accept()
    assert (m.running, m.accepted) == (4, 6)
    assert m.capacity(0) == 2  # min(10 - 4, 12 - (6 + 4))
    _submit(m, 2)
    assert m.capacity(0) == 0
    assert m.capacity(1) == 4  # min(10 - 6, 16 - 12)
    assert m.capacity(5) == 4  # concurrency binds: min(10 - 6, 32 - 12)


def test_synchronous_when_eta_zero() -> None:
    m = StalenessManager(batch_size=3, max_staleness=0, max_concurrent=100)
    assert m.capacity(0) == 3
    _submit(m, 3)
    for _ in range(3):
        m.on_accept()
    assert m.capacity(0) == 0  # the batch of version 0 is complete: nothing for version 1 yet
    assert m.capacity(1) == 3


def test_reject_frees_a_slot_and_discard_reopens_one() -> None:
    m = StalenessManager(batch_size=2, max_staleness=0, max_concurrent=8)
    _submit(m, 2)
    m.on_reject()  # e.g. dynamic sampling dropped the group: draw a replacement
    assert m.capacity(0) == 1
    m.on_accept()
    assert m.capacity(0) == 1
    m.on_discard()  # an accepted group went stale before training
    assert (m.accepted, m.rejected, m.capacity(0)) == (0, 2, 2)


def test_accepted_never_exceeds_bound_random_race() -> None:
    rng = random.Random(0)
    for eta in (0, 1, 3):
        m = StalenessManager(batch_size=3, max_staleness=eta, max_concurrent=5)
        version, trained = 0, 0
        for _ in range(3000):
            event = rng.random()
            if event < 0.4:
                _submit(m, rng.randint(0, m.capacity(version)))
            elif event < 0.8 and m.running:
                m.on_accept() if rng.random() < 0.8 else m.on_reject()
            elif m.accepted - trained >= m.batch_size:  # the trainer takes a batch, then updates weights
                trained += m.batch_size
                version += 1
            assert m.accepted <= m.limit(version)
            assert m.accepted + m.running <= m.limit(version)
            assert m.running <= m.max_concurrent
            assert m.capacity(version) >= 0
        assert version > 10  # the race really progressed


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        StalenessManager(0, 1, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessManager(1, -1, 1)
    m = StalenessManager(1, 0, 1)
    with pytest.raises(RuntimeError, match="no group is running"):
        m.on_accept()
    with pytest.raises(RuntimeError, match="no accepted group"):
        m.on_discard()
    with pytest.raises(ValueError, match="version"):
        m.capacity(-1)


def test_state_dict_round_trip_drops_running() -> None:
    m = StalenessManager(batch_size=2, max_staleness=1, max_concurrent=8)
    _submit(m, 4)
    m.on_accept()
    m.on_reject()
    state = m.state_dict()
    fresh = StalenessManager(batch_size=2, max_staleness=1, max_concurrent=8)
    fresh.load_state_dict(state)
    # the 2 running groups are regenerated after a restart: not submitted, not running
    assert (fresh.accepted, fresh.rejected, fresh.running, fresh.submitted) == (1, 1, 0, 2)
    assert fresh.capacity(0) == 3
    with pytest.raises(ValueError, match="batch_size"):
        StalenessManager(batch_size=3, max_staleness=1, max_concurrent=8).load_state_dict(state)

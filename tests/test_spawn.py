"""The N-process harness: results in rank order, a failing rank's traceback, timeouts."""

from __future__ import annotations

import os
import time

import pytest

from realscale.parallel.spawn import DistributedError, run_distributed

pytestmark = pytest.mark.multiproc


def _allreduce_rank() -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def _fail_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    time.sleep(30)


def _hang() -> None:
    time.sleep(60)


def _die() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(30)


def test_results_in_rank_order() -> None:
    assert run_distributed(_allreduce_rank, 3, timeout=60) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_failing_rank_traceback_is_reported() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 of 2 failed:[\s\S]*ValueError: rank one is broken"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 25  # the sleeping rank was killed, not waited for


def test_timeout_kills_ranks() -> None:
    with pytest.raises(DistributedError, match="did not finish within 3 s"):
        run_distributed(_hang, 2, timeout=3)


def test_dead_rank_is_reported() -> None:
    with pytest.raises(DistributedError, match="rank 0 died"):
        run_distributed(_die, 2, timeout=60)


def _die_mid_collective() -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # fails when rank 1's sockets close


@pytest.mark.parametrize("attempt", range(3))
def test_a_death_is_reported_before_the_errors_it_causes(attempt: int) -> None:
    # Rank 1's death makes rank 0 fail a moment later; which of the two reaches the
    # harness first is a race (CI once saw the peer's "Connection reset" instead of the
    # death), so the scenario runs three times.
    with pytest.raises(DistributedError, match=r"^rank 1 died \(exit code 3\)"):
        run_distributed(_die_mid_collective, 2, timeout=60)

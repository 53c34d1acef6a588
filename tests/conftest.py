"""Shared test setup: markers, GPU skipping, keeping torch to few threads, the device contract."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
# The device contract (realscale/parallel/device.py): every rank these tests start (spawned
# gloo ranks, realscale train's trainer ranks) fails a collective tensor that skipped the
# device helper, as NCCL would fail it on a GPU.
os.environ.setdefault("REALSCALE_DEVICE_CONTRACT", "nccl")

MULTIPROC_TIMEOUT_S = 900


def _leave_slurm_allocation() -> None:
    """Tests start their runs on this machine. Inside a Slurm allocation (a batch script or
    an salloc shell) ``launch.backend=auto`` would turn them into job steps instead, so the
    session forgets the allocation; the Slurm tests name their backend, or submit their own
    jobs, and do not need it."""
    from realscale.launcher.slurm import in_allocation  # the rule launch.backend=auto applies

    if in_allocation():
        for key in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            os.environ.pop(key, None)


_leave_slurm_allocation()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "slow: long-running; excluded from the default run (-m 'not slow')")
    config.addinivalue_line("markers", "multiproc: spawns several torch.distributed processes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import importlib.util

    has_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        has_cuda = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        # spawned gloo ranks start slower than the 600 s hang guard of pytest.ini allows
        # for; an end-to-end test names its own budget (pytest.mark.timeout)
        if "multiproc" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(MULTIPROC_TIMEOUT_S))


@pytest.fixture(scope="module")
def tiny_server():
    """(Serving and inference tests) a tiny-qwen2 embedded server on a free port; yields (url, EmbeddedServer)."""
    from realscale.serve.server import EmbeddedServer, start_in_thread

    server = EmbeddedServer("tiny-qwen2", max_running=16, context_length=256)
    url, stop = start_in_thread(server)
    yield url, server
    stop()

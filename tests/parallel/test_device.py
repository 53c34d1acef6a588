"""The device rules (realscale/parallel/device.py), each one helper, and the collective
buffers that use them: on CPU the helper says gloo/CPU, and every buffer that enters a
collective is where the helper says (on GPUs the same calls give the current CUDA device)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from realscale.parallel.device import comm_device, comm_empty, devices_of_server, group_backend, to_comm


def test_comm_device_and_buffers_on_cpu() -> None:
    assert comm_device("gloo") == torch.device("cpu")
    buf = comm_empty(5, torch.bfloat16, "gloo")
    assert (buf.device, buf.dtype, buf.shape) == (comm_device("gloo"), torch.bfloat16, (5,))
    t = torch.arange(6).view(2, 3).t()  # not contiguous
    moved = to_comm(t, "gloo")
    assert moved.is_contiguous() and moved.device == comm_device("gloo") and torch.equal(moved, t)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_nccl_needs_cuda() -> None:
    from realscale.parallel.device import BackendError, backend

    with pytest.raises(BackendError, match="parallel.backend=nccl needs CUDA"):
        backend("nccl")
    assert backend("auto") == "gloo"


def test_group_backend_of_a_store_built_group() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    pg = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30))
    assert group_backend(pg) == "gloo"


def test_server_gpus_follow_the_trainers() -> None:
    # trainer ranks 0..3 hold GPUs 0..3; server 1 of tp=2 starts at GPU 4 + 2
    assert devices_of_server(4 + 1 * 2, 2) == "6,7"
    assert devices_of_server(3, 1) == "3"


def test_senders_and_resharder_put_their_buffers_where_the_helper_says() -> None:
    from realscale.inference.weight_sync import WeightSender

    assert WeightSender("127.0.0.1", 1, 2, backend="gloo").device == comm_device("gloo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_every_rank_device_comes_from_one_helper_on_cpu(monkeypatch) -> None:
    from realscale.parallel.device import BackendError, local_device, rank_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_device() == torch.device("cpu")  # a trainer rank (GPUs: cuda:<LOCAL_RANK>, made current)
    assert rank_device("cpu", 1) == torch.device("cpu")  # a server rank (GPUs: cuda:<first + rank>, made current)
    with pytest.raises(BackendError, match="needs CUDA"):
        rank_device("cuda:0", 1)


def test_the_weight_world_buffers_follow_the_helper() -> None:
    """A trainer rank's source buffer and a server rank's receive buffer are made by the
    same helper the collective's device comes from."""
    from realscale.parallel.device import store_group

    buf = comm_empty(3, torch.float32, "gloo")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    pg = store_group(store, 0, 1, "gloo", datetime.timedelta(seconds=30))
    assert group_backend(pg) == "gloo" and buf.device == comm_device(group_backend(pg))
    pg.allreduce([buf.fill_(1.0)]).wait()  # it enters the collective as it is
    assert buf.tolist() == [1.0, 1.0, 1.0]


def test_the_device_contract_catches_a_tensor_that_skipped_the_helper(monkeypatch) -> None:
    """REALSCALE_DEVICE_CONTRACT=nccl: on gloo, only tensors the helper made (or views of
    them) may enter a collective, as only those would be on the GPU under NCCL; a real
    NCCL collective takes CUDA tensors only. Off: no check."""
    from realscale.parallel.device import CONTRACT_ENV, BackendError, DeviceContractError, check_comm

    monkeypatch.setenv(CONTRACT_ENV, "nccl")
    host = torch.ones(4, dtype=torch.float64)
    with pytest.raises(DeviceContractError, match="did not come from realscale.parallel.device.to_comm"):
        check_comm(host, "gloo")
    with pytest.raises(DeviceContractError, match="NCCL takes CUDA tensors only"):
        check_comm(host, "nccl")  # a stray .cpu() on the NCCL path
    moved, buf = to_comm(host.clone(), "gloo"), comm_empty((2, 3), torch.int64, "gloo")
    assert check_comm(moved, "gloo") is moved
    check_comm(buf, "gloo")
    check_comm(buf.view(-1)[1:4], "gloo")  # a view of a helper's buffer
    with pytest.raises(DeviceContractError):
        check_comm(moved * 2, "gloo")  # computed from one, but not the helper's
    monkeypatch.setenv(CONTRACT_ENV, "off")
    check_comm(host, "gloo")
    monkeypatch.setenv(CONTRACT_ENV, "cuda")
    with pytest.raises(BackendError, match=CONTRACT_ENV):
        check_comm(host, "gloo")


def test_cuda_usable_without_a_gpu_device_node_does_not_import_torch(tmp_path) -> None:
    """No device node CUDA (or HIP, or WSL's) needs: False, and torch stays unimported (the
    supervisor's preflight asks before it starts anything); with one, torch is asked."""
    import subprocess
    import sys

    code = ("import sys, realscale.parallel.device as d; d._GPU_DEVICE_NODES = (sys.argv[1],); "
            "print(d.cuda_usable(), 'torch' in sys.modules)")
    absent = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nvidiactl")], capture_output=True, text=True,
                            timeout=120)
    assert absent.stdout.split() == ["False", "False"], absent.stderr[-2000:]
    (tmp_path / "nvidiactl").touch()
    present = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nvidiactl")], capture_output=True,
                             text=True, timeout=120)
    import torch

    assert present.stdout.split() == [str(torch.cuda.is_available() and torch.cuda.device_count() > 0), "True"]

"""The one place that chooses the collective backend and the device of this process.

"The cluster path is the CPU path": every distributed code path (trainer ranks, weight
groups, resharding, batch scatter) runs the same logic on gloo/CPU here and NCCL/CUDA on
GPUs. What differs is only what this module returns, so nothing else asks
``torch.cuda.is_available()`` to pick a backend or a device.

Rules:

- ``backend("auto")`` is NCCL when CUDA is usable, else gloo; an explicit choice is
  checked (NCCL without CUDA is an error naming the knob).
- ``local_device()`` is ``cuda:<LOCAL_RANK mod visible GPUs>`` on GPUs, else ``cpu``;
  :func:`init_distributed` calls ``torch.cuda.set_device`` on it *before* the process
  group exists, as NCCL requires.
- ``comm_device(backend)``: where a tensor must live to enter a collective of that
  backend (NCCL: the current CUDA device; gloo: CPU). Every buffer a collective touches
  is allocated or moved there through :func:`to_comm`.
"""

from __future__ import annotations

import os
from typing import Any


class BackendError(ValueError):
    """A backend that cannot run on this machine."""


def cuda_usable() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def backend(requested: str = "auto") -> str:
    """The torch.distributed backend for ``requested`` (auto, nccl or gloo)."""
    if requested == "auto":
        return "nccl" if cuda_usable() else "gloo"
    if requested == "nccl" and not cuda_usable():
        raise BackendError("parallel.backend=nccl needs CUDA GPUs, and none is visible; use auto or gloo")
    if requested not in ("nccl", "gloo"):
        raise BackendError(f"parallel.backend: {requested!r} is not one of 'auto', 'nccl', 'gloo'")
    return requested


def local_device() -> Any:
    """This process's device: its GPU (by LOCAL_RANK) when CUDA is usable, else the CPU."""
    import torch

    if not cuda_usable():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def comm_device(backend_name: str) -> Any:
    """Where tensors must be to enter a collective of ``backend_name``."""
    import torch

    if backend_name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_comm(tensor: Any, backend_name: str) -> Any:
    """``tensor`` on the device a collective of ``backend_name`` needs, contiguous."""
    return tensor.to(comm_device(backend_name), non_blocking=False).contiguous()


def init_distributed(requested: str = "auto") -> str:
    """Set this process's device, then ``init_process_group`` from the usual variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless already done. Returns the backend."""
    import torch
    import torch.distributed as dist

    name = backend(requested)
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(name)
    return dist.get_backend()

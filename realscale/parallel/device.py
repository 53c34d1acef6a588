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
  is allocated there (:func:`comm_empty`) or moved there (:func:`to_comm`): the weight
  sender's buckets, the pipeline export's receive buffers, the resharder's buffers.
- ``group_backend(group)``: the backend of a process group, also of one built directly
  from a store (``ProcessGroupGloo`` / ``ProcessGroupNCCL``, which torch.distributed's
  own ``get_backend`` does not know).
- ``devices_of_server(first_gpu, ranks)``: which GPUs a generation server's ranks use
  on a local GPU machine (``CUDA_VISIBLE_DEVICES`` of its process); trainer rank ``r``
  uses GPU ``r`` (:func:`local_device`), servers the GPUs after the trainer's.
"""

from __future__ import annotations

import os
from typing import Any

from realscale.errors import UserError


class BackendError(UserError):
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


def comm_empty(numel: int, dtype: Any, backend_name: str) -> Any:
    """An uninitialised 1-D buffer where a collective of ``backend_name`` can use it."""
    import torch

    return torch.empty(numel, dtype=dtype, device=comm_device(backend_name))


def group_backend(group: Any) -> str:
    """``"nccl"`` or ``"gloo"`` for a process group (torch.distributed's, or one made from a store)."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroupGloo):
        return "gloo"
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
    if nccl is not None and isinstance(group, nccl):
        return "nccl"
    return str(dist.get_backend(group))


def devices_of_server(first_gpu: int, ranks: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a local generation server whose ranks start at GPU ``first_gpu``."""
    return ",".join(str(first_gpu + k) for k in range(ranks))


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


def rank_device(requested: str, rank: int) -> Any:
    """The device of rank ``rank`` of a multi-process component that was asked for
    ``requested`` (``cpu``, ``cuda`` or ``cuda:i``): ranks take consecutive GPUs from
    ``i`` (wrapping around the visible ones) and make theirs the current device."""
    import torch

    dev = torch.device(requested)
    if dev.type != "cuda":
        return torch.device("cpu")
    if not cuda_usable():
        raise BackendError(f"device {requested!r} needs CUDA, and no GPU is visible")
    dev = torch.device("cuda", ((dev.index or 0) + rank) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def store_group(store: Any, rank: int, world: int, backend_name: str, timeout: Any) -> Any:
    """A process group over ``store`` that is *not* the default group (a process can hold
    several: a generation server's ranks, then a weight group with a trainer)."""
    import torch.distributed as dist

    if backend_name == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if backend_name == "nccl":  # GPU only; not run on the CPU test machine
        return dist.ProcessGroupNCCL(store, rank, world)
    raise BackendError(f"backend: {backend_name!r} is not one of 'gloo', 'nccl'")

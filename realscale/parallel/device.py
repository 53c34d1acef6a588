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
- ``init_distributed(requested, timeout_s)``: the default group's timeout is the
  caller's (the trainer's ``parallel.collective_timeout_s``, :func:`collective_timeout_s`),
  never NCCL's 10-minute default (``kProcessGroupNCCLDefaultTimeout``,
  torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp:157-158). Waits of unbounded length
  (a rank waiting for the driver's rollouts) do not sit in a collective of that group at
  all: they wait on a gloo side group of their own (:func:`wait_group`, e.g. the batch
  scatter's start).

**The device contract.** Every tensor realscale hands to a collective (torch.distributed's
``all_reduce`` / ``broadcast`` / ``all_gather`` / ``send`` / ``recv`` / ..., and the
weight senders' store-built groups) comes from :func:`to_comm` or :func:`comm_empty`,
right where it enters. ``REALSCALE_DEVICE_CONTRACT=nccl`` checks that
(:func:`check_comm`): :func:`init_distributed` then wraps torch.distributed's tensor
collectives so that every call made from realscale's own modules (not megatron's or
torch's) passes each tensor through the check; the callers of ``isend`` / ``irecv``
(not wrapped: see ``_COLLECTIVES``) and the weight senders call it themselves. With a
real NCCL group the check is NCCL's own rule (the tensor is on a CUDA device; vLLM's
``PyNcclCommunicator.broadcast`` asserts it, vllm/distributed/device_communicators/
pynccl.py:541). On CPU (gloo), where every tensor is on the device gloo wants, it
*simulates NCCL*: the tensor (or the tensor it is a view of) must carry the mark that
:func:`to_comm` / :func:`comm_empty` set while the contract is on, so a tensor that
skipped the helper (a stray ``.cpu()``, a fresh CPU tensor) fails the CPU test that NCCL
would fail on a GPU. Blind spots: ``.cpu()`` of a marked CPU tensor is the same tensor on
CPU, so it stays marked; host staging before the helper (GPU -> CPU -> GPU) passes; the
server side's groups (the embedded engine's TP ranks, weight receivers, vLLM's gloo
engine) are not checked. The tests run with the contract on (tests/conftest.py).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import sys
from typing import Any

from realscale.errors import UserError

CONTRACT_ENV = "REALSCALE_DEVICE_CONTRACT"
_MARK = "_realscale_comm"  # set by to_comm / comm_empty while the contract is on
# torch.distributed's tensor collectives that the contract wraps (object collectives place
# their own tensors; barriers carry none). Not isend / irecv: torch tells a P2POp's kind by
# their identity (``op.op is isend``, torch/distributed/distributed_c10d.py: _check_op,
# batch_isend_irecv), which megatron's pipeline uses; realscale's isend / irecv callers call
# check_comm themselves.
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter", "gather", "send", "recv")
# A rank waiting for the driver (its rollouts, its end of a phase) waits on a gloo side group
# this long: as long as generation may take, not a collective's timeout.
WAIT_TIMEOUT = datetime.timedelta(days=1)


class BackendError(UserError):
    """A backend that cannot run on this machine."""


class DeviceContractError(RuntimeError):
    """A tensor entered a collective without the device helper (module docstring)."""


# CUDA (and ROCm's HIP behind torch.cuda, and WSL's) cannot run without one of these device
# nodes: where none exists, torch need not be imported to say so.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def cuda_usable() -> bool:
    """Whether torch can use a CUDA device here. On a host with no GPU device node the
    answer is no without importing torch (~2 CPU-seconds, which the supervisor's preflight
    paid before starting anything on the 2-core default recipe)."""
    if not any(os.path.exists(node) for node in _GPU_DEVICE_NODES):
        return False
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


def to_comm(tensor: Any, backend_name: str, device: Any = None) -> Any:
    """``tensor`` on the device a collective of ``backend_name`` needs (or ``device``, a
    sender's own GPU), contiguous; the one way into a collective (module docstring)."""
    target = comm_device(backend_name) if device is None else device
    return _marked(tensor.to(target, non_blocking=False).contiguous())


def comm_empty(shape: Any, dtype: Any, backend_name: str) -> Any:
    """An uninitialised buffer of ``shape`` (an int: 1-D) where a collective of
    ``backend_name`` can use it."""
    import torch

    return _marked(torch.empty(shape, dtype=dtype, device=comm_device(backend_name)))


def device_contract() -> str:
    """The checking mode ``REALSCALE_DEVICE_CONTRACT`` names: ``"nccl"``, or ``""`` (off)."""
    value = os.environ.get(CONTRACT_ENV, "").strip().lower()
    if value in ("", "0", "off"):
        return ""
    if value != "nccl":
        raise BackendError(f"{CONTRACT_ENV}={value!r}: use nccl (check every collective's tensors) or off")
    return value


def _marked(tensor: Any) -> Any:
    if device_contract():
        setattr(tensor, _MARK, True)
    return tensor


def check_comm(tensor: Any, backend_name: str, where: str = "a collective") -> Any:
    """Under the contract, fail unless ``tensor`` may enter a collective of ``backend_name``:
    on a CUDA device for NCCL; on CPU, made by :func:`to_comm` / :func:`comm_empty` (the
    NCCL simulation, module docstring). Returns ``tensor``; a no-op when the contract is off."""
    if not device_contract():
        return tensor
    if backend_name == "nccl":
        if tensor.device.type != "cuda":
            raise DeviceContractError(f"{where}: a {tensor.dtype} {list(tensor.shape)} tensor on {tensor.device} "
                                      "entered an NCCL collective; NCCL takes CUDA tensors only")
        return tensor
    base = tensor._base if tensor._base is not None else tensor
    if not (getattr(tensor, _MARK, False) or getattr(base, _MARK, False)):
        raise DeviceContractError(
            f"{where}: a {tensor.dtype} {list(tensor.shape)} tensor on {tensor.device} did not come from "
            "realscale.parallel.device.to_comm / comm_empty; under NCCL it would not be on the GPU "
            f"({CONTRACT_ENV}=nccl simulates NCCL on {backend_name})")
    return tensor


def install_device_contract() -> bool:
    """Under the contract, wrap torch.distributed's tensor collectives (once per process) so
    that calls from realscale's own modules check every tensor; True when installed."""
    import torch.distributed as dist

    if not device_contract():
        return False
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "_realscale_checked", False):
            setattr(dist, name, _checked(fn, name))
    return True


def _checked(fn: Any, name: str) -> Any:
    import torch
    import torch.distributed as dist

    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("realscale.") and device_contract():
            bound = sig.bind_partial(*args, **kwargs).arguments
            group = bound.get("group")
            backend_name = group_backend(group) if group is not None else str(dist.get_backend())
            for value in bound.values():
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor):
                        check_comm(t, backend_name, f"torch.distributed.{name} in {caller}")
        return fn(*args, **kwargs)

    call._realscale_checked = True  # type: ignore[attr-defined]
    return call


def wait_group() -> Any:
    """A gloo group of every rank of the default group with :data:`WAIT_TIMEOUT`: where a
    rank waits for the driver for as long as generation takes (NCCL's watchdog would end
    such a wait inside an NCCL collective). Collective: every rank calls it, in the same order."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=WAIT_TIMEOUT)


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


def init_distributed(requested: str = "auto", timeout_s: float | None = None) -> str:
    """Set this process's device, then ``init_process_group`` from the usual variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless already done, with a timeout of
    ``timeout_s`` (None: torch's default; the trainer passes :func:`collective_timeout_s`).
    Installs the device contract's check when it is on. Returns the backend."""
    import torch
    import torch.distributed as dist

    name = backend(requested)
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(name, timeout=timeout)
        _timeout["s"] = timeout_s
    install_device_contract()
    return dist.get_backend()


_timeout: dict[str, float | None] = {"s": None}


def default_group_timeout_s() -> float | None:
    """The timeout :func:`init_distributed` gave the default group (None: torch's default),
    for the groups made after it (megatron's)."""
    return _timeout["s"]


# What a trainer rank may wait inside one collective of the default group while the driver
# works outside it (the rollouts are waited for on a side group, not here): a publish's
# control calls (pause, weight load, resume), each up to the client's control limit
# (realscale.inference.client.CONTROL_TIMEOUT_S, 600 s), plus NCCL's own 10 minutes for the
# collectives themselves.
CONTROL_CALLS_PER_PUBLISH = 3
CONTROL_CALL_S = 600.0
NCCL_DEFAULT_S = 600.0


def collective_timeout_s(setting: float) -> float:
    """The default group's timeout for ``parallel.collective_timeout_s`` (0: auto, the
    module's bound of one publish; > 0: as given)."""
    if setting > 0:
        return float(setting)
    return CONTROL_CALLS_PER_PUBLISH * CONTROL_CALL_S + NCCL_DEFAULT_S


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

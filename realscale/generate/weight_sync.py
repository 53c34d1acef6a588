"""Weight transport from trainer to generation servers over torch.distributed.

The protocol is SGLang's: the trainer is rank 0 of a *separate* process group ("weight
update group") that every server joins at ``rank_offset + local_rank`` after a POST to
``/init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``,
``world_size``, ``group_name``, ``backend``). For each bucket of HF-named full tensors the
trainer POSTs ``/update_weights_from_distributed`` with ``names``/``dtypes``/``shapes``
and broadcasts the tensors from rank 0, one ``broadcast`` per tensor in ``names`` order
(what SGLang's receiver expects). gloo on CPU, NCCL on GPU.

The group is built directly from a ``TCPStore`` (``ProcessGroupGloo`` /
``ProcessGroupNCCL``), never through ``init_process_group``: the trainer already has a
default group (its Megatron world) and the server may have one too.
"""

from __future__ import annotations

import datetime
from typing import Any, Iterable

import torch

Bucket = list[tuple[str, torch.Tensor]]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
           "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form SGLang's ``dtypes`` field uses)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def new_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
              backend: str, timeout_s: float = 120.0) -> Any:
    """Join (rank 0: host) a process group that leaves any default group alone.

    Blocks until all ``world_size`` ranks have joined.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(master_address, master_port, world_size, is_master=(rank == 0),
                                       timeout=timeout)
    store = torch.distributed.PrefixStore(group_name, store)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":  # GPU only; not run on the CPU test machine
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"backend: {backend!r} is not one of 'gloo', 'nccl'")


def bucket_meta(bucket: Bucket) -> dict[str, list[Any]]:
    """The ``names``/``dtypes``/``shapes`` fields of ``/update_weights_from_distributed``."""
    return {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


class WeightSender:
    """Trainer side (rank 0): host the group, then broadcast buckets to all servers."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo", device: str | None = None) -> None:
        from realscale.parallel.device import comm_device

        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        # every bucket enters the broadcast where the backend needs it (NCCL: this GPU)
        self.device = torch.device(device) if device is not None else comm_device(backend)
        self.group: Any = None

    def init_request(self, rank_offset: int) -> dict[str, Any]:
        """The ``/init_weights_update_group`` body for a server whose first rank is ``rank_offset``."""
        return {"master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": rank_offset, "world_size": self.world_size,
                "group_name": self.group_name, "backend": self.backend}

    def connect(self, timeout_s: float = 120.0) -> None:
        """Create the group as rank 0 (blocks until every server has joined)."""
        self.group = new_group(self.master_address, self.master_port, 0, self.world_size, self.group_name,
                               self.backend, timeout_s)

    def broadcast_bucket(self, bucket: Bucket) -> int:
        """Send every tensor of ``bucket`` (in order); returns the bytes sent."""
        if self.group is None:
            raise RuntimeError("WeightSender.connect() was not called")
        sent = 0
        for _, tensor in bucket:
            t = tensor.detach().to(self.device).contiguous()
            self.group.broadcast(t, 0).wait()
            sent += t.numel() * t.element_size()
        return sent

    def reopen(self, world_size: int) -> None:
        """Drop the group and host a new one of ``world_size`` ranks on a fresh free port
        (after a server left: the next :meth:`connect` waits for the remaining ones)."""
        from realscale.parallel.spawn import free_port

        self.group = None
        self.world_size = world_size
        self.master_port = free_port(self.master_address)

    def close(self) -> None:
        self.group = None


class WeightReceiver:
    """Server side: join the group at a given rank and receive buckets into new tensors."""

    def __init__(self) -> None:
        self.groups: dict[str, tuple[Any, torch.device]] = {}

    def init_group(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                   backend: str, device: torch.device, timeout_s: float = 120.0) -> None:
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} already exists")
        self.groups[group_name] = (new_group(master_address, master_port, rank, world_size, group_name, backend,
                                             timeout_s), device)

    def destroy_group(self, group_name: str) -> None:
        if self.groups.pop(group_name, None) is None:
            raise ValueError(f"no weight update group named {group_name!r}")

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                group_name: str) -> Bucket:
        """Receive one bucket broadcast from rank 0, in ``names`` order."""
        if group_name not in self.groups:
            raise ValueError(f"no weight update group named {group_name!r}; call /init_weights_update_group first")
        group, device = self.groups[group_name]
        out: Bucket = []
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=parse_dtype(dt), device=device)
            group.broadcast(t, 0).wait()
            out.append((name, t))
        return out


# One bucketing rule for the trainer's export and any other sender (re-exported here).
from realscale.models.convert import split_buckets  # noqa: E402,F401

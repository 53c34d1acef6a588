"""Weight transport from trainer to generation servers over torch.distributed, as SGLang does it.

The protocol is the pinned SGLang's (``sglang_reference.PINNED``; the contract tests run
SGLang's own receiver code against this sender). The trainer is rank 0 of a *separate*
process group, the "weight update group"; a server with ``tp`` ranks joins it after a
POST to ``/init_weights_update_group`` (``master_address``, ``master_port``,
``rank_offset``, ``world_size``, ``group_name``, ``backend``): its tensor-parallel rank
``r`` joins as ``rank_offset + r``, so the world is 1 sender + every rank of every
server. An update is a session: ``/begin_weight_update``, then per bucket of HF-named
full tensors a POST to ``/update_weights_from_distributed`` (``names``/``dtypes``/
``shapes``) while rank 0 broadcasts the tensors, one ``broadcast`` per name in order
(every server rank receives every tensor whole and loads its own shard of it), then
``/end_weight_update``. gloo on CPU, NCCL on GPU.

The group is built the way SGLang's ``init_custom_process_group`` builds it, so both sides
meet at the same store keys: a TCP rendezvous (``tcp://addr:port``; rank 0 hosts the
TCPStore), a ``PrefixStore(group_name)`` over it, and torch's
``_new_process_group_helper`` (which adds ``{group_name}/`` and ``{device}/`` prefixes of
its own), never ``init_process_group``: the trainer already has a default group (its
Megatron world) and so has every SGLang server. The one departure: SGLang waits for the
rendezvous for torch's default 30 minutes; here the caller bounds it (``timeout_s``).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from realscale.parallel.device import check_comm, comm_device, to_comm
from realscale.parallel.net import free_port

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


def _tcp_url(host: str, port: int) -> str:
    """``tcp://host:port`` (an IPv6 host in brackets), as SGLang's ``NetworkAddress.to_tcp``."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def new_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
              backend: str, timeout_s: float = 120.0) -> Any:
    """Join (rank 0: host) the weight-update group exactly as SGLang's receiver creates it.

    Blocks until all ``world_size`` ranks have joined. ``group_name`` must be unused in
    this process (torch keeps one registry of group names); :func:`destroy_group` frees it.
    """

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: {backend!r} is not one of 'gloo', 'nccl'")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(_tcp_url(master_address, master_port), rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout, device_id=None)
    # collectives address the group by global rank: make global rank i group rank i
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group: Any) -> None:
    """Release a group from :func:`new_group` and its name (as SGLang's destroy does)."""
    torch.distributed.destroy_process_group(group)


FLATTENED = "flattened_bucket"  # SGLang's load_format: a bucket's tensors as one byte buffer


def flat_offsets(dtypes: list[str], shapes: list[list[int]]) -> list[int]:
    """Byte offsets of a flattened bucket's tensors, and its size last. Each tensor starts
    at a multiple of its element size, as SGLang's receiver requires (else ValueError)."""
    offsets = [0]
    for dt, shape in zip(dtypes, shapes):
        size = parse_dtype(dt).itemsize
        if offsets[-1] % size:
            raise ValueError(f"flattened bucket: a {dt} tensor at byte offset {offsets[-1]} is not aligned")
        offsets.append(offsets[-1] + math.prod(shape) * size)
    return offsets


def bucket_meta(bucket: Bucket) -> dict[str, list[Any]]:
    """The ``names``/``dtypes``/``shapes`` fields of ``/update_weights_from_distributed``."""
    return {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


class WeightSender:
    """Trainer side (rank 0): host the group, then broadcast buckets to all servers."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo", device: str | None = None) -> None:
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

    def broadcast_bucket(self, bucket: Bucket, load_format: str | None = None) -> int:
        """Send every tensor of ``bucket`` (in order), or with ``load_format =
        "flattened_bucket"`` all of them as one byte buffer; returns the bytes sent."""
        if self.group is None:
            raise RuntimeError("WeightSender.connect() was not called")
        if load_format == FLATTENED:
            flat_offsets([dtype_name(t.dtype) for _, t in bucket], [list(t.shape) for _, t in bucket])
            tensors = [to_comm(torch.cat([t.detach().to(self.device).contiguous().flatten().view(torch.uint8)
                                          for _, t in bucket]), self.backend, self.device)]
        elif load_format is None:
            tensors = [to_comm(t.detach(), self.backend, self.device) for _, t in bucket]
        else:
            raise ValueError(f"load_format: {load_format!r} is not None or {FLATTENED!r}")
        for t in tensors:
            self.group.broadcast(check_comm(t, self.backend, "weight-update broadcast"), 0).wait()
        return sum(t.numel() * t.element_size() for t in tensors)

    def reopen(self, world_size: int) -> None:
        """Drop the group and host a new one of ``world_size`` ranks on a fresh free port
        (after a server left: the next :meth:`connect` waits for the remaining ones)."""

        self.close()
        self.world_size = world_size
        self.master_port = free_port(self.master_address)

    def close(self) -> None:
        if self.group is not None:
            destroy_group(self.group)
        self.group = None


@dataclasses.dataclass
class WeightPart:
    """One weight group's share of an update session: its sender and its buckets, and how
    many buckets there are when known ahead (then the next bucket is exported while one
    is sent)."""

    sender: Any  # WeightSender, or RemoteSender for a group another process sends on
    buckets: Iterable[Bucket]
    count: int | None = None


class RemoteSender:
    """Rank 0's handle on a weight group that another trainer rank hosts and broadcasts on
    (a pipeline stage's leader): what the servers are told to join (``init_request``) and
    the group's name; its broadcasts happen in that process, so :meth:`broadcast_bucket`
    sends nothing here: before the group's first bucket of a round, tells the
    leader to start (:meth:`signal`, over the trainer's own store: a leader whose part
    never comes, because the update failed before it, is told so instead of waiting in a
    broadcast until the group's timeout)."""

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
                 store: Any = None, key: str = "") -> None:
        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        self.store = store
        self.key = key
        self.started = False

    init_request = WeightSender.init_request

    def connect(self, timeout_s: float = 120.0) -> None:
        """The leader hosts the group; the servers' joins end once it is formed."""

    def signal(self, go: bool) -> None:
        """Tell the leader whether its part of this round is sent (once per round)."""
        if self.store is not None and not self.started:
            self.store.set(self.key, b"go" if go else b"skip")
        self.started = True

    def broadcast_bucket(self, bucket: Bucket, load_format: str | None = None) -> int:
        """The leader's part begins (once); this process sends no byte of it."""
        self.signal(True)
        return 0

    def close(self) -> None:
        """Nothing held here: the leader drops its own group."""


def send_overlapped(buckets: Iterable[Bucket], send: Callable[[Bucket], int]) -> int:
    """``send`` every bucket in order, the next bucket's export (``buckets`` is a lazy
    export: TP gathers, casts) running while the previous one is sent; returns the bytes
    sent. A failed send raises after the bucket in flight has ended; the caller drains
    the rest of ``buckets`` (its collectives) itself."""
    sent = 0
    with ThreadPoolExecutor(1, thread_name_prefix="weight-send") as pool:
        pending: Future[int] | None = None
        for bucket in buckets:
            if pending is not None:
                sent += pending.result()
            pending = pool.submit(send, bucket)
        if pending is not None:
            sent += pending.result()
    return sent


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
        entry = self.groups.pop(group_name, None)
        if entry is None:
            raise ValueError(f"no weight update group named {group_name!r}")
        destroy_group(entry[0])

    def close(self) -> None:
        """Destroy every group (a server shutting down frees the group names)."""
        for name in list(self.groups):
            self.destroy_group(name)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                group_name: str, load_format: str | None = None) -> Bucket:
        """Receive one bucket broadcast from rank 0, in ``names`` order (one broadcast per
        tensor, or one byte buffer with ``load_format = "flattened_bucket"``)."""
        if group_name not in self.groups:
            raise ValueError(f"no weight update group named {group_name!r}; call /init_weights_update_group first")
        group, device = self.groups[group_name]
        if load_format == FLATTENED:
            offsets = flat_offsets(dtypes, shapes)
            flat = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
            group.broadcast(flat, 0).wait()
            return [(name, flat[start:end].view(parse_dtype(dt)).reshape(shape))
                    for name, dt, shape, start, end in zip(names, dtypes, shapes, offsets, offsets[1:])]
        out: Bucket = []
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=parse_dtype(dt), device=device)
            group.broadcast(t, 0).wait()
            out.append((name, t))
        return out


# One bucketing rule for the trainer's export and any other sender (re-exported here).
from realscale.models.convert import split_buckets  # noqa: E402,F401

"""Map a Megatron model's local parameter shards to slices of the full tensors.

megatron-core describes every parameter with ``sharded_state_dict()``: a global key
(layers stacked on a leading axis), the global shape, and where this rank's shard sits
in it. From that we can load full (unsharded) tensors into any (tp, pp, dp) layout and
read shards of weights or gradients back as slices of the full tensors. Tests use it to
compare N-process runs with a single-process run; checkpoints can use it to move
between layouts.

Keys are megatron's global checkpoint keys, e.g. ``decoder.layers.self_attention.
linear_qkv.weight`` with shape ``[num_layers, 3 * ..., hidden]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class ShardSlot:
    """One local shard: ``view`` is this rank's tensor (a view into the parameter),
    ``index`` selects the same elements from the full tensor ``key``."""

    key: str
    global_shape: tuple[int, ...]
    index: tuple[int | slice, ...]
    view: torch.Tensor
    param: torch.nn.Parameter


def _index(offsets: tuple[int, ...], prepend: int, local_shape: tuple[int, ...]) -> tuple[int | slice, ...]:
    # Prepended axes (stacked layers) hold a single index; the rest are ranges.
    idx: list[int | slice] = list(offsets[:prepend])
    for off, size in zip(offsets[prepend:], local_shape):
        idx.append(slice(off, off + size))
    return tuple(idx)


def _owning_param(view: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.nn.Parameter:
    ptr = view.data_ptr()
    for p in params:
        start = p.data_ptr()
        if start <= ptr < start + p.numel() * p.element_size():
            return p
    raise LookupError("shard view does not point into any parameter of the model")


def shard_slots(model: torch.nn.Module) -> list[ShardSlot]:
    """Every parameter shard of ``model`` (a megatron module, unwrapped or DDP-wrapped)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    module = getattr(model, "module", model)
    sharded = module.sharded_state_dict()
    apply_factories(sharded)
    params = list(module.parameters())
    slots = []
    for value in nested_values(sharded):
        if not isinstance(value, ShardedTensor) or value.data is None:
            continue
        if not value.data.is_floating_point():
            continue
        try:
            param = _owning_param(value.data, params)
        except LookupError:  # buffers (e.g. rotary inv_freq) are not trained weights
            continue
        slots.append(ShardSlot(value.key, tuple(value.global_shape),
                               _index(tuple(value.global_offset), value.prepend_axis_num, tuple(value.data.shape)),
                               value.data, param))
    return slots


def _matching(view: torch.Tensor, param: torch.nn.Parameter, other: torch.Tensor) -> torch.Tensor:
    """The elements of ``other`` (laid out like ``param``) at ``view``'s position."""
    offset = (view.data_ptr() - param.data_ptr()) // param.element_size()
    base = other.reshape(param.shape)
    if not base.is_contiguous() or not param.is_contiguous():
        raise ValueError("shard mapping needs contiguous parameters and gradients")
    return base.as_strided(view.shape, view.stride(), base.storage_offset() + offset)


def grad_of(slot: ShardSlot) -> torch.Tensor:
    """The gradient of this shard (``main_grad`` under Megatron DDP, else ``.grad``)."""
    grad = getattr(slot.param, "main_grad", None)
    if grad is None:
        grad = slot.param.grad
    if grad is None:
        raise ValueError(f"{slot.key}: parameter has no gradient")
    return _matching(slot.view, slot.param, grad)


@torch.no_grad()
def load_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy the matching slice of each full tensor into this rank's shards."""
    for slot in shard_slots(model):
        if slot.key not in full:
            raise KeyError(f"full state dict has no tensor for '{slot.key}'")
        src = full[slot.key]
        if tuple(src.shape) != slot.global_shape:
            raise ValueError(f"'{slot.key}': full tensor has shape {tuple(src.shape)}, model expects {slot.global_shape}")
        slot.view.copy_(src[slot.index])


def iter_local(model: torch.nn.Module, grads: bool = False) -> Iterator[tuple[ShardSlot, torch.Tensor]]:
    """(slot, local tensor) for each shard: the weight, or its gradient when ``grads``."""
    for slot in shard_slots(model):
        yield slot, (grad_of(slot) if grads else slot.view)


@torch.no_grad()
def gather_full_single(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors from a model whose shards cover everything (a single-process model)."""
    out: dict[str, torch.Tensor] = {}
    for slot, local in iter_local(model, grads):
        full = out.setdefault(slot.key, torch.zeros(slot.global_shape, dtype=local.dtype))
        full[slot.index] = local
    return out

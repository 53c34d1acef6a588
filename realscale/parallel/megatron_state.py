"""Bring up megatron-core's process groups for a (tp, pp, dp) layout on this process.

The only place that calls ``parallel_state.initialize_model_parallel``: model code and
the engine ask this module, never torch.distributed directly, for the layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """A Megatron 3D layout. dp is implied by the world size."""

    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False


def init_distributed(backend: str = "auto") -> None:
    """``init_process_group`` from the usual env vars (RANK, WORLD_SIZE, MASTER_*), if
    not already done. ``auto`` picks nccl with CUDA, else gloo."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def init_megatron(layout: Layout, seed: int = 1234) -> None:
    """Patch megatron for CPU when needed, create its TP/PP/DP groups and seed its RNG
    tracker. Requires torch.distributed to be initialised."""
    import torch.distributed as dist

    import megatron_patches.cpu as mp_cpu

    mp_cpu.apply()
    from megatron.core import parallel_state, tensor_parallel

    world = dist.get_world_size()
    if world % (layout.tp * layout.pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {layout.tp}*{layout.pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_megatron() -> None:
    """Tear down megatron's groups (the process group itself stays)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()

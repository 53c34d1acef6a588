"""Bring up megatron-core's process groups for a (tp, pp, dp) layout on this process.

The only place that calls ``parallel_state.initialize_model_parallel``: model code and
the engine ask this module, never torch.distributed directly, for the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from realscale.parallel.device import default_group_timeout_s
from realscale.parallel.device import init_distributed  # noqa: F401 - the one helper, re-exported
from realscale.parallel.mesh import Strategy


@dataclass(frozen=True)
class Layout:
    """A Megatron 3D layout. dp is implied by the world size."""

    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    ep: int = 1  # expert parallelism (mixture-of-experts models): carved out of dp, as megatron does


def init_megatron(layout: Layout, seed: int = 1234) -> None:
    """Patch megatron for CPU when needed, create its TP/PP/DP groups and seed its RNG
    tracker. Requires torch.distributed to be initialised."""
    import torch.distributed as dist

    import megatron_patches.cpu as mp_cpu
    import megatron_patches.fixes as mp_fixes

    mp_cpu.apply()
    mp_fixes.apply()
    from megatron.core import parallel_state, tensor_parallel

    world = dist.get_world_size()
    if world % (layout.tp * layout.pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {layout.tp}*{layout.pp}")
    if (world // (layout.tp * layout.pp)) % layout.ep:
        raise ValueError(f"ep={layout.ep} must divide the data-parallel size {world // (layout.tp * layout.pp)} "
                         f"(world {world} / tp {layout.tp} / pp {layout.pp}): experts are spread over dp ranks")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # megatron's groups time out with the default group (init_distributed), not after
    # megatron's own 30 minutes
    timeout_s = default_group_timeout_s()
    extra = {} if timeout_s is None else {"distributed_timeout_minutes": math.ceil(timeout_s / 60)}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        **extra,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_megatron() -> None:
    """Tear down megatron's groups (the process group itself stays)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the megatron layout, and its groups."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    pp_ranks: tuple[int, ...]
    sequence_parallel: bool
    # expert parallelism (a mixture-of-experts model): this rank holds experts
    # [ep_rank * E/ep, (ep_rank + 1) * E/ep), each split over the expert tp group
    ep: int = 1
    ep_rank: int = 0
    ep_group: object = None
    etp_rank: int = 0
    etp_group: object = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def last_stage_rank(self) -> int:
        return self.pp_ranks[-1]

    @property
    def strategy(self) -> Strategy:
        """The layout as a plan names it (``d<dp>t<tp>p<pp>``, ``e<ep>`` with expert parallelism)."""
        return Strategy(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep)

    def world_rank(self) -> int:
        """This rank's global rank in Megatron's order (tp fastest, then dp, then pp), which
        is what torch.distributed's rank must be for every plan that reads shards by rank."""
        return self.strategy.local_rank(self.dp_rank, self.tp_rank, self.pp_rank)


def rank_info(sequence_parallel: bool = False) -> RankInfo:
    """This process's place in the layout set up by :func:`init_megatron`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    return RankInfo(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=pp_group,
        dp_group=ps.get_data_parallel_group(), pp_ranks=tuple(dist.get_process_group_ranks(pp_group)),
        sequence_parallel=sequence_parallel,
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(), etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_group=ps.get_expert_tensor_parallel_group(),
    )

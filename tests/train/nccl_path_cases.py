"""Per-rank workers of test_nccl_path.py (spawned gloo ranks)."""

from __future__ import annotations

from typing import Any


def normalize_over_dp(advantages: list[list[float]], masks: list[list[float]]) -> list[float]:
    """``algo.normalize_adv_over_batch``'s all-reduce of the batch moments, as a trainer rank
    runs it: this rank's share on the host (where the batch scatter hands it back)."""
    import torch
    import torch.distributed as dist

    from realscale.train.actor import normalize_over_batch
    from realscale.train.batch import PackedBatch

    rank = dist.get_rank()
    adv, mask = torch.tensor(advantages[rank]), torch.tensor(masks[rank])
    share = PackedBatch.from_sequences([torch.arange(adv.numel())], {"advantages": [adv], "loss_mask": [mask]})
    normalize_over_batch([share], dist.group.WORLD)
    return share.fields["advantages"].tolist()


def late_driver_batch(delay_s: float, num_seqs: int) -> dict[str, Any]:
    """The batch scatter of a step whose batch the driver holds only after ``delay_s``
    (longer than the default group's timeout): the other ranks wait for it."""
    import time

    import torch.distributed as dist
    from batch_scatter_cases import synthetic_batch

    from realscale.config import AlgoConfig
    from realscale.parallel.megatron_state import Layout, destroy_megatron, init_megatron, rank_info
    from realscale.train.actor import split_for_dp, stage_needs
    from realscale.train.batch_scatter import BatchScatter

    init_megatron(Layout(tp=1, pp=1))
    r = rank_info()
    scatter = BatchScatter(r, stage_needs(AlgoConfig()))
    split = None
    start = time.monotonic()
    if dist.get_rank() == 0:
        time.sleep(delay_s)  # generating the first batch
        split = split_for_dp(synthetic_batch(num_seqs), 1, r.dp)
    shares, _ = scatter.scatter(split)
    waited = time.monotonic() - start
    destroy_megatron()
    return {"seqs": sum(s.num_seqs for s in shares), "waited": waited}


def export_devices(model_dir: str, tp: int) -> dict[str, list[str]]:
    """Where the weight export yields its tensors: by default on the collective device
    (here made a distinct device, ``meta``, so that a host copy shows), and on the CPU
    when asked (the disk path)."""
    import torch

    import realscale.train.engine as E
    from engine_cases import engine

    eng = engine(model_dir, tp=tp, lr=None)
    real = E.comm_device
    E.comm_device = lambda backend: torch.device("meta")  # what the GPU is under NCCL
    try:
        default = sorted({str(t.device) for b in eng.export_hf_weights() for _, t in b})
    finally:
        E.comm_device = real
    disk = sorted({str(t.device) for b in eng.export_hf_weights(device="cpu") for _, t in b})
    return {"default": default, "disk": disk}

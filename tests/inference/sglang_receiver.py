"""SGLang's own weight-update receiver, run on CPU from the pinned source (test helper).

:func:`sglang_weight_updater` executes, verbatim from the downloaded SGLang source
(``sglang_reference.load_definitions``), the class a SGLang server's every TP rank uses to
join the weight-update group and receive broadcasts
(``model_runner_components/weight_updater.py: WeightUpdater``) together with what it calls:
``utils/common.py: init_custom_process_group``, ``utils/network.py: NetworkAddress`` and
``weight_sync/tensor_bucket.py: FlattenedTensorBucket``.
Nothing is stubbed on the path under test; the constructor's model hooks (model config,
loaders, CUDA-graph recapture) are given ``None``/no-ops because joining and receiving do
not touch them. SGLang's package itself cannot be imported here (CUDA-only imports).

:func:`weight_world` is one rank of a weight world (run by ``run_distributed``): rank 0 is
our trainer-side sender, then the ranks of each server in ``servers``, each joining at
``rank_offset + tp_rank``: ``"sglang"`` ranks through SGLang's receiver, ``"embedded"``
ranks through the embedded server's :class:`~realscale.inference.weight_sync.WeightReceiver`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from realscale.inference import sglang_reference as ref
from realscale.inference.weight_sync import FLATTENED, WeightReceiver, WeightSender, bucket_meta

MODEL_RUNNER_UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"


def sglang_weight_updater(tp_rank: int) -> Any:
    """SGLang's ``WeightUpdater`` for TP rank ``tp_rank`` of a CPU server."""
    net = ref.load_definitions("sglang/srt/utils/network.py", ["logger", "_is_ipv6", "_wrap", "NetworkAddress"])
    common = ref.load_definitions("sglang/srt/utils/common.py", ["torch_release", "init_custom_process_group"])
    bucket = ref.load_definitions("sglang/srt/weight_sync/tensor_bucket.py",
                                  ["FlattenedTensorMetadata", "FlattenedTensorBucket"])
    mod = ref.load_definitions(MODEL_RUNNER_UPDATER, ["logger", "WeightUpdater"], {
        "NetworkAddress": net["NetworkAddress"], "init_custom_process_group": common["init_custom_process_group"],
        "FlattenedTensorBucket": bucket["FlattenedTensorBucket"]})
    return mod["WeightUpdater"](tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=None,
                                custom_weight_loaders={}, get_model=lambda: None,
                                update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
                                get_model_runner=lambda: None)


def make_buckets(seed: int = 0) -> list[list[tuple[str, torch.Tensor]]]:
    """HF-named tensors of several dtypes and shapes (a 0-d one too), in three buckets."""
    g = torch.Generator().manual_seed(seed)
    return [
        [("model.embed_tokens.weight", torch.randn(11, 8, generator=g)),
         ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8, generator=g).to(torch.bfloat16))],
        [("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=g).half()),
         ("model.norm.step", torch.randint(0, 1000, (2, 3), generator=g)),
         ("lm_head.scale", torch.tensor(1.5))],
        [("model.layers.0.input_layernorm.weight", torch.rand(8, generator=g))],
    ]


def _call(fn: Any, body: dict[str, Any]) -> Any:
    """Call SGLang's method with an HTTP body's fields, as its scheduler does (a field the
    method does not take is an error: our body would not fit SGLang's receiver)."""
    params = inspect.signature(fn).parameters
    unknown = set(body) - set(params)
    if unknown:
        raise TypeError(f"{fn.__qualname__} takes no {sorted(unknown)}")
    return fn(**body)


def load_format(update: int) -> str | None:
    """Updates alternate SGLang's two formats: one broadcast per tensor, one per bucket."""
    return FLATTENED if update % 2 else None


def _sglang_rank(sender: WeightSender, rank_offset: int, tp_rank: int, n_updates: int) -> list[Any]:
    updater = sglang_weight_updater(tp_rank)
    init = sender.init_request(rank_offset)
    ok, message = _call(updater.init_weights_update_group, init)
    assert ok, message
    received = []
    for update in range(n_updates):
        for bucket in make_buckets():
            received += [(n, t.clone()) for n, t in _call(updater.receive_weights_from_distributed, {
                **bucket_meta(bucket), "group_name": init["group_name"], "load_format": load_format(update)})]
    ok, message = updater.destroy_weights_update_group(init["group_name"])
    assert ok, message
    return received


def _embedded_rank(sender: WeightSender, rank_offset: int, tp_rank: int, n_updates: int) -> list[Any]:
    init = sender.init_request(rank_offset)
    receiver = WeightReceiver()
    receiver.init_group(init["master_address"], init["master_port"], init["rank_offset"] + tp_rank,
                        init["world_size"], init["group_name"], init["backend"], torch.device("cpu"), timeout_s=60)
    received = []
    for update in range(n_updates):
        for bucket in make_buckets():
            meta = bucket_meta(bucket)
            received += [(n, t.clone()) for n, t in receiver.receive(meta["names"], meta["dtypes"], meta["shapes"],
                                                                     init["group_name"], load_format(update))]
    receiver.close()
    return received


def weight_world(port: int, servers: list[tuple[str, int]], group_name: str, n_updates: int) -> Any:
    """One rank's part; ``servers`` = [(kind, tp)] in rank-offset order."""
    world = 1 + sum(tp for _, tp in servers)
    sender = WeightSender("127.0.0.1", port, world_size=world, group_name=group_name, backend="gloo")
    rank = dist.get_rank()
    if rank == 0:
        sender.connect(timeout_s=60)
        sent = sum(sender.broadcast_bucket(b, load_format(u)) for u in range(n_updates) for b in make_buckets())
        sender.close()
        return sent
    offset = 1
    for kind, tp in servers:
        if rank < offset + tp:
            part = _sglang_rank if kind == "sglang" else _embedded_rank
            return part(sender, offset, rank - offset, n_updates)
        offset += tp
    raise AssertionError(f"rank {rank} is in no server of {servers}")

"""Fast rules of the gloo twin of vLLM's shard-to-shard engine (``gloo_m2n``,
:mod:`realscale.inference.vllm_m2n`) and of the Megatron source it sends from
(:class:`realscale.publish.vllm_source.MegatronShardSource`): no processes, no servers.

What vLLM's ``nccl_m2n`` (0.32) fixes and these tests hold the twin to, by file:line in
``vllm/distributed/weight_transfer/``:

- a mesh is 2 axes over a contiguous rank interval, ranks row-major (``m2n_common.py:92-117``);
- a placement is one SHARD and one REPLICATE axis, a whole tensor is ``REPLICATED`` and
  resolves to a ``(size, 1)`` mesh with ``(REPLICATE, 0)`` (``m2n_common.py:127-175``);
- shards are equal chunks (``validate_layout``, ``m2n_common.py:221-242``);
- the destination mesh's axis 1 shards, axis 0 replicates (``m2n_common.py:33-36``);
- the worker init info carries the whole plan (``m2n_engine.py:78-140``) and is built by
  the trainer as ``m2n_trainer.py:767-787``.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import fields

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm.distributed.weight_transfer.m2n_common import (
    REPLICATE,
    REPLICATED,
    M2NMesh,
    resolve_layout,
)
from vllm.distributed.weight_transfer.m2n_engine import M2NWeightTransferInitInfo

from realscale.inference.vllm_m2n import (
    GlooM2NWeightTransferInitInfo,
    _local,
    box_numel,
    lower_bound_elems,
    plan_pieces,
    shard_box,
)


def _simulate(full: torch.Tensor, src, dst) -> dict[int, torch.Tensor]:
    """Every destination rank's buffer after the pieces of :func:`plan_pieces` land, each
    piece cut from its sender's own shard (what :func:`reshard` does over gloo)."""
    shape = tuple(full.shape)
    out = {}
    for q in range(dst[0].start_rank, dst[0].start_rank + dst[0].size):
        want = shard_box(shape, *dst, q)
        out[q] = torch.full([hi - lo for lo, hi in want], float("nan"))
    for p in plan_pieces(shape, src, dst):
        held = shard_box(shape, *src, p.src)
        assert held is not None, "a piece from a rank that holds nothing of the tensor"
        mine = full[tuple(slice(lo, hi) for lo, hi in held)]  # the sender's local shard
        region = out[p.dst][_local(p.box, shard_box(shape, *dst, p.dst))]
        assert torch.isnan(region).all(), "a destination element arrived twice"
        region.copy_(mine[_local(p.box, held)])
    return out


LAYOUTS = [  # (src mesh dims, start, placements) as the Megatron source declares them
    ((1, 2), 0, (REPLICATE, 0)),  # tp2, column-parallel
    ((1, 2), 0, (REPLICATE, 1)),  # tp2, row-parallel
    ((2, 2), 0, (REPLICATE, 0)),  # dp2 x tp2
    ((1, 1), 1, REPLICATED),  # pp2, tp1: stage 1's tensor
    ((1, 2), 2, (REPLICATE, 1)),  # tp2 x pp2: stage 1's row-parallel tensor
    ((2, 1), 0, REPLICATED),  # dp2: replicas take turns
]
DESTS = [((1, 2), (REPLICATE, 0)), ((1, 2), (REPLICATE, 1)), ((1, 2), REPLICATED), ((2, 2), (REPLICATE, 0)),
         ((3, 1), REPLICATED)]


@pytest.mark.parametrize("src_layout,dst_layout", list(itertools.product(LAYOUTS, DESTS)))
def test_every_destination_element_arrives_once_from_a_holder(src_layout, dst_layout) -> None:
    """Any source layout into any destination layout: each worker ends with exactly its
    destination region of the full tensor, every element sent once by a rank that holds
    it; the bytes sent are the lower bound (each worker's destination, once)."""
    (sdims, start, spl), (ddims, dpl) = src_layout, dst_layout
    trainer_ranks = 4
    src = resolve_layout(M2NMesh(sdims, start), spl)
    dst = resolve_layout(M2NMesh(ddims, trainer_ranks), dpl)
    full = torch.arange(4 * 6 * 2, dtype=torch.float32).reshape(4, 6, 2)
    got = _simulate(full, src, dst)
    for q, buf in got.items():
        want = shard_box(full.shape, *dst, q)
        assert torch.equal(buf, full[tuple(slice(lo, hi) for lo, hi in want)])
    pieces = plan_pieces(full.shape, src, dst)
    assert sum(box_numel(p.box) for p in pieces) == lower_bound_elems(full.shape, dst)
    assert all(p.src < trainer_ranks <= p.dst for p in pieces)


def test_replicas_take_turns_and_shards_go_straight() -> None:
    """dp2 x tp2 -> a tp2 server, both sharded on dim 0: worker j gets its half from one
    rank of tp rank j, the two data-parallel replicas alternating over workers; a
    replicated destination gets both tp halves, worker j from replica j."""
    shape = (8, 4)
    src = resolve_layout(M2NMesh((2, 2), 0), (REPLICATE, 0))
    dst = resolve_layout(M2NMesh((1, 2), 4), (REPLICATE, 0))
    assert [(p.src, p.dst, p.box) for p in plan_pieces(shape, src, dst)] == [
        (0, 4, ((0, 4), (0, 4))), (3, 5, ((4, 8), (0, 4)))]  # replica 0's tp0, replica 1's tp1
    rep = resolve_layout(M2NMesh((1, 2), 4), REPLICATED)
    assert {(p.src, p.dst) for p in plan_pieces(shape, src, rep)} == {(0, 4), (1, 4), (2, 5), (3, 5)}
    assert lower_bound_elems(shape, rep) == 2 * 32 and lower_bound_elems(shape, dst) == 32


def test_rank_order_is_row_major_from_the_start_rank() -> None:
    """ncclMesh_t: ranks [start, start + d0*d1), axis 1 fastest (m2n_common.py:92-117)."""
    mesh = M2NMesh((2, 3), 5)
    assert shard_box((6, 9), mesh, (REPLICATE, 1), 5) == ((0, 6), (0, 3))
    assert shard_box((6, 9), mesh, (REPLICATE, 1), 9) == ((0, 6), (3, 6))  # coord (1, 1)
    assert shard_box((6, 9), mesh, (0, REPLICATE), 9) == ((3, 6), (0, 9))
    assert shard_box((6, 9), mesh, (REPLICATE, 1), 4) is None and shard_box((6, 9), mesh, (REPLICATE, 1), 11) is None


def _worker_info(**kw):
    base = dict(master_address="127.0.0.1", master_port=1, rank_offset=4, world_size=6, src_mesh_dims=[1, 2],
                dst_mesh_dims=[1, 2], names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[4], [4]],
                src_placements=[None, [REPLICATE, 0]])
    return GlooM2NWeightTransferInitInfo(**{**base, **kw})


def test_init_info_is_vllms_plus_the_pipeline_extension() -> None:
    """The worker init info has every field of vLLM's (m2n_engine.py:78-106) and only
    src_mesh_starts / first_worker_rank / timeout_s besides; a stage mesh must lie inside
    the trainer's ranks, and without stages the mesh must cover them all
    (m2n_engine.py:204-211)."""
    ours = {f.name for f in fields(GlooM2NWeightTransferInitInfo)}
    theirs = {f.name for f in fields(M2NWeightTransferInitInfo)}
    assert ours - theirs == {"src_mesh_starts", "first_worker_rank", "timeout_s"} and theirs <= ours
    assert _worker_info(src_mesh_starts=[0, 2]).src_mesh_starts == [0, 2]
    with pytest.raises(ValueError, match="leaves the 4 trainer ranks"):
        _worker_info(src_mesh_starts=[0, 3])
    with pytest.raises(ValueError, match="covers 2 ranks, but there are 4"):
        _worker_info()
    with pytest.raises(ValueError, match="dst_mesh_dims"):
        _worker_info(src_mesh_starts=[0, 2], dst_mesh_dims=[1, 3])


def _arch(family: str = "qwen2", vocab: int = 100):
    from realscale.models.family import arch_from_hf

    return arch_from_hf({"model_type": family, "vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
                         "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": False})


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("family,vocab", [("qwen2", 100), ("llama", 256)])
def test_megatron_local_shards_are_equal_chunks_of_the_hf_tensors(tp, pp, family, vocab) -> None:
    """Each Megatron rank's local shard (built from random HF tensors by the loader's own
    hf_to_megatron), split by split_local, is exactly the tp-th equal chunk of every HF
    tensor along the dim shard_layout declares (fused qkv with GQA, [gate_t; up_t], the
    vocabulary); a padded vocabulary (100 rows -> 128) is declared whole (gathered), an
    unpadded one (256) sharded; stages follow the layer split."""
    from realscale.models.convert import hf_to_megatron
    from realscale.publish.vllm_source import shard_layout, split_local

    arch = _arch(family, vocab)
    padded = arch.padded_vocab(tp)
    layout = shard_layout(arch, tp, pp, padded)
    torch.manual_seed(0)
    hf = {e.hf_name: torch.randn(e.shape) for e in layout}
    by_param: dict[str, list] = {}
    for e in layout:
        by_param.setdefault(e.megatron_name, []).append(e)
    assert len(hf) == len(layout)
    for entries in by_param.values():
        kind = entries[0].kind
        for t in range(tp):
            local = hf_to_megatron(kind, [hf[e.hf_name] for e in entries], arch, t, tp, padded)
            if entries[0].gathered:  # what the tp all-gather hands back: the full padded tensor
                local = torch.cat([hf_to_megatron(kind, [hf[e.hf_name] for e in entries], arch, r, tp, padded)
                                   for r in range(tp)])
            for e, piece in zip(entries, split_local(kind, local, arch)):
                want = hf[e.hf_name] if e.dim is None else hf[e.hf_name].chunk(tp, dim=e.dim)[t]
                assert torch.equal(piece, want), (e.hf_name, t)
    vocab_entries = [e for e in layout if e.kind == "vocab"]
    assert all(e.gathered == (tp > 1 and padded != vocab) for e in vocab_entries)
    assert {e.stage for e in layout if ".layers.3." in e.hf_name} == {pp - 1}
    assert {e.stage for e in layout if e.hf_name == "model.embed_tokens.weight"} == {0}


def test_the_knob_picks_the_engine_on_both_sides() -> None:
    """generate.vllm_weight_engine=m2n: the server is started with gloo_m2n (nccl_m2n on
    GPUs) and the trainer's transport drives the same engine; anything else is refused."""
    from realscale.config import Config, ConfigError, GenerateConfig
    from realscale.inference.vllm_server import vllm_command, weight_engine
    from realscale.publish.publisher import transport_for

    gen = GenerateConfig(backend="vllm", tp=2, vllm_weight_engine="m2n")
    cmd = vllm_command("/m", 8000, gen)
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "gloo_m2n"}'
    assert [weight_engine(g, k) for g in (False, True) for k in ("broadcast", "m2n")] == [
        "gloo", "gloo_m2n", "nccl", "nccl_m2n"]
    cfg = Config()
    cfg.generate = gen
    t = transport_for(cfg, "/tmp/run")
    assert t.engine_name == "gloo_m2n" and t.m2n
    with pytest.raises(ConfigError, match="vllm_weight_engine"):
        GenerateConfig(backend="vllm", vllm_weight_engine="nccl")


def test_nccl_m2n_refuses_a_pipeline_parallel_trainer() -> None:
    """vLLM's nccl_m2n has one trainer mesh for every parameter (m2n_engine.py:204-211):
    a pp > 1 trainer is refused before anything starts, naming the alternative."""
    from types import SimpleNamespace

    from realscale.publish.vllm import VllmEngineTransport

    engine = SimpleNamespace(ranks=SimpleNamespace(pp=2))
    with pytest.raises(ValueError, match="vllm_weight_engine=broadcast"):
        VllmEngineTransport("nccl_m2n").connect(engine, None)


def test_sync_client_sends_vllms_init_info_to_one_server_and_places_several() -> None:
    """One server: the trainer's m2n init info goes out unchanged (vLLM's protocol);
    several: rank_offset stays the destination mesh's start and each server is told where
    its workers begin (first_worker_rank); broadcast engines keep one offset per server."""
    from types import SimpleNamespace

    from realscale.publish.vllm import VllmSyncClient

    control = SimpleNamespace(servers=[SimpleNamespace(url="a", ranks=2), SimpleNamespace(url="b", ranks=2)])
    client = VllmSyncClient(control)
    sent = []
    client._fan_out = lambda path, body: sent.append([body(i, u) for i, u in enumerate(client.members)])
    m2n = {"rank_offset": 4, "world_size": 8, "src_mesh_dims": [1, 4]}
    client.members = ["a"]
    client.init_weight_transfer_engine(m2n)
    client.members = ["a", "b"]
    client.init_weight_transfer_engine(m2n)
    client.init_weight_transfer_engine({"rank_offset": 1})
    assert sent[0] == [{"init_info": m2n}]
    assert [b["init_info"]["first_worker_rank"] for b in sent[1]] == [4, 6]
    assert {b["init_info"]["rank_offset"] for b in sent[1]} == {4}
    assert [b["init_info"]["rank_offset"] for b in sent[2]] == [1, 3]
    assert client.destination_mesh(["a", "b"]) == (2, 2)
    client.trainer_ranks = 4
    assert client.world_size(["a", "b"]) == 8

"""A rank's flat weight buffer: HF tensors in any bucketing land exactly where
``pack_shard`` puts the full tensors' slices; bad input is refused before any write."""

from __future__ import annotations

import pytest
import torch

from realscale.serve.weights import RankWeights, full_megatron_tensors, read_hf_config
from realscale.models.tiny import resolve_model_path
from realscale.parallel.reshard_exec import pack_shard


def _state(model: str) -> tuple[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    path = resolve_model_path(model)
    return path, load_file(f"{path}/model.safetensors")


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-qwen3", "tiny-llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_buckets_in_any_order_fill_the_expected_shard(model: str, tp: int) -> None:
    path, state = _state(model)
    cfg = read_hf_config(path)
    for rank in range(tp):
        from_dir = RankWeights.allocate(cfg, tp, rank, torch.float32, torch.device("cpu"))
        from_dir.load_dir(path)
        streamed = RankWeights.allocate(cfg, tp, rank, torch.float32, torch.device("cpu"))
        loader = streamed.loader()
        names = sorted(state, reverse=True)  # v before k before q: fused tensors wait for their parts
        for i in range(0, len(names), 3):
            loader.add([(n, state[n]) for n in names[i:i + 3]])
        loader.end_update()
        full = full_megatron_tensors(state.items(), streamed.spec, streamed.arch)
        expected = pack_shard(streamed.spec, streamed.layout, rank, full)
        assert torch.equal(streamed.flat, expected) and torch.equal(from_dir.flat, expected)
        assert streamed.hashes() == from_dir.hashes()


def test_bad_tensors_are_refused_before_writing() -> None:
    path, state = _state("tiny-qwen2")
    w = RankWeights.allocate(read_hf_config(path), 2, 1, torch.float32, torch.device("cpu"))
    w.load_dir(path)
    before = w.flat.clone()
    loader = w.loader()
    good = ("model.norm.weight", torch.zeros_like(state["model.norm.weight"]))
    with pytest.raises(KeyError, match="unknown parameter name.*model.nope"):
        loader.add([good, ("model.nope", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight: shape \(3, 3\)"):
        loader.add([good, ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])
    assert torch.equal(w.flat, before)
    # half a fused tensor: nothing written, and the end of the update says what is missing
    loader.add([("model.layers.1.self_attn.q_proj.weight", state["model.layers.1.self_attn.q_proj.weight"] + 1)])
    assert torch.equal(w.flat, before)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        loader.end_update()
    with pytest.raises(ValueError, match="holds"):
        w.copy_flat(torch.zeros(3))

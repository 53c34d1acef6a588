"""An abstract model: named tensors with full shapes, how tensor parallelism splits them,
and which pipeline stage owns them.

The resharder and the cost model never look at a real module; they look at a
:class:`ModelSpec`. The one sharding rule is: **a tensor-parallel tensor is split along
one dim into ``tp`` equal contiguous chunks** (``split_dim``), or replicated
(``split_dim=None``, e.g. norms). Megatron's layouts that are *not* contiguous chunks of
the HF tensor are expressed by choosing the full shape so that they are:

- fused QKV with GQA: Megatron interleaves per query group ``[q_g..., k_g, v_g]``, and
  tensor parallelism takes whole groups. Full shape ``(groups, (q_per_group + 2) * head_dim,
  hidden)`` split along dim 0.
- gated MLP ``linear_fc1``: each tp rank holds ``[gate_t; up_t]``. Full shape
  ``(2, ffn, hidden)`` split along dim 1.

Mixture of experts: each layer has a replicated router ``(experts, hidden)`` and, per
expert ``e``, ``linear_fc1`` / ``linear_fc2`` shaped and split like a dense MLP's (expert
tensor parallelism = tp). ``expert`` marks them; under a strategy with ``ep > 1`` only the
ranks of expert-parallel rank ``e // (experts / ep)`` hold expert ``e``
(:meth:`ModelSpec.holds`).

Pipeline: ``layer`` is the decoder layer index; ``-1`` means pre-process (embedding,
first stage) and ``n_layers`` post-process (final norm, output head, last stage).
``also_last`` marks a tied embedding, which Megatron keeps on the first *and* last stage.
"""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass, field

from realscale.parallel.mesh import LayoutError, Strategy


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor of the full (unsharded) model."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None
    layer: int
    also_last: bool = False
    expert: int = -1  # global expert index of a mixture-of-experts weight; -1: not an expert's

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def view3(self) -> tuple[int, int, int]:
        """``(outer, rows, inner)``: the tensor viewed so that tp splits the middle dim.

        A replicated tensor is one row block: ``(1, numel, 1)``."""
        if self.split_dim is None:
            return 1, self.numel, 1
        d = self.split_dim
        return math.prod(self.shape[:d]), self.shape[d], math.prod(self.shape[d + 1:])

    def chunks(self, tp: int) -> int:
        """How many tp chunks this tensor is cut into under tensor-parallel degree ``tp``."""
        return 1 if self.split_dim is None else tp

    def row_range(self, tp: int, tp_rank: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of the split dim held by ``tp_rank``."""
        _, rows, _ = self.view3()
        n = self.chunks(tp)
        c = 0 if n == 1 else tp_rank
        return c * rows // n, (c + 1) * rows // n


@dataclass(frozen=True)
class ModelSpec:
    """The tensors of a model, plus the head counts that decide valid tp degrees."""

    tensors: tuple[TensorSpec, ...]
    n_layers: int
    itemsize: int = 2
    n_heads: int = 0
    n_kv_heads: int = 0
    hidden: int = 0
    ffn: int = 0
    vocab: int = 0
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise LayoutError(f"model spec: duplicate tensor names {dup[:3]}")
        for t in self.tensors:
            if t.split_dim is not None and not 0 <= t.split_dim < len(t.shape):
                raise LayoutError(f"model spec: tensor {t.name} has split_dim {t.split_dim} "
                                  f"but only {len(t.shape)} dims")
            if not -1 <= t.layer <= self.n_layers:
                raise LayoutError(f"model spec: tensor {t.name} has layer {t.layer} outside [-1, {self.n_layers}]")

    @functools.cached_property
    def n_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    def param_bytes(self) -> int:
        return self.n_params * self.itemsize

    def stages_of(self, t: TensorSpec, partition: tuple[int, ...]) -> tuple[int, ...]:
        """Pipeline stages that hold tensor ``t`` under ``partition`` (layers per stage)."""
        last = len(partition) - 1
        if t.layer < 0:
            return (0, last) if t.also_last and last > 0 else (0,)
        if t.layer >= self.n_layers:
            return (last,)
        acc = 0
        for s, n in enumerate(partition):
            acc += n
            if t.layer < acc:
                return (s,)
        raise LayoutError(f"partition {list(partition)} does not cover layer {t.layer} of tensor {t.name}")

    @property
    def num_experts(self) -> int:
        return int(self.meta.get("num_experts", 0))

    def holds(self, t: TensorSpec, partition: tuple[int, ...], strategy: Strategy, dp: int, stage: int) -> bool:
        """Whether the ranks at data-parallel coordinate ``dp`` of pipeline stage ``stage``
        hold (their tp chunk of) tensor ``t``: its stage, and for an expert's weight, its
        expert-parallel rank."""
        if stage not in self.stages_of(t, partition):
            return False
        if t.expert < 0 or strategy.ep == 1:
            return True
        return t.expert // (self.num_experts // strategy.ep) == strategy.ep_rank(dp)

    def check_strategy(self, strategy: Strategy) -> None:
        """Raise :class:`LayoutError` saying why this model cannot run under ``strategy``."""
        tp, pp = strategy.tp, strategy.pp
        if strategy.ep > 1 and (not self.num_experts or self.num_experts % strategy.ep):
            what = f"the {self.num_experts} experts" if self.num_experts else "a dense model (no experts)"
            raise LayoutError(f"ep={strategy.ep} does not divide {what}")
        if self.n_heads and self.n_heads % tp:
            raise LayoutError(f"tp={tp} does not divide the {self.n_heads} attention heads")
        if self.n_kv_heads and self.n_kv_heads % tp:
            raise LayoutError(f"tp={tp} does not divide the {self.n_kv_heads} key/value head groups "
                              "(Megatron shards GQA attention by whole query groups)")
        if pp > self.n_layers:
            raise LayoutError(f"pp={pp} is more than the model's {self.n_layers} layers: some stage would be empty")
        for t in self.tensors:
            if t.split_dim is not None and t.shape[t.split_dim] % tp:
                raise LayoutError(f"tp={tp} does not divide dim {t.split_dim} (size {t.shape[t.split_dim]}) "
                                  f"of tensor {t.name}")


def pad_vocab(vocab: int, multiple: int = 128) -> int:
    """Megatron pads the vocabulary so every tp shard is equal; we pad once to a fixed
    multiple (128 covers every tp dividing 128) so the full tensor does not depend on tp.
    The trainer's Megatron model pads the same way (``ModelArch.padded_vocab``: a multiple
    of ``lcm(128, tp)``), so trainer and server shards are slices of one full tensor."""
    return -(-vocab // multiple) * multiple


def transformer_spec(hidden: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int, vocab: int,
                     head_dim: int | None = None, tie_embeddings: bool = False, qkv_bias: bool = True,
                     qk_norm: bool = False, itemsize: int = 2, vocab_multiple: int = 128,
                     num_experts: int = 0, moe_ffn: int = 0, moe_topk: int = 0) -> ModelSpec:
    """The Megatron parameter list of a Qwen2/Qwen3/Llama-style decoder (names follow
    megatron-core's GPTModel with the local layer spec); ``num_experts > 0``: every layer's
    MLP is a mixture of ``num_experts`` experts of width ``moe_ffn``, ``moe_topk`` per token
    (Qwen3-MoE; ``ffn`` is then unused)."""
    if num_experts and (moe_ffn < 1 or not 1 <= moe_topk <= num_experts):
        raise LayoutError(f"transformer spec: {num_experts} experts need moe_ffn >= 1 and 1 <= moe_topk <= "
                          f"{num_experts}, got {moe_ffn} and {moe_topk}")
    for name, value in (("hidden", hidden), ("n_layers", n_layers), ("n_heads", n_heads),
                        ("n_kv_heads", n_kv_heads), ("ffn", ffn), ("vocab", vocab)):
        if value < 1:
            raise LayoutError(f"transformer spec: {name} must be >= 1, got {value}")
    if n_heads % n_kv_heads:
        raise LayoutError(f"transformer spec: {n_heads} heads are not a multiple of {n_kv_heads} kv heads")
    hd = head_dim or hidden // n_heads
    if head_dim is None and hidden % n_heads:
        raise LayoutError(f"transformer spec: hidden {hidden} is not a multiple of {n_heads} heads; pass head_dim")
    q_per_group = n_heads // n_kv_heads
    vp = pad_vocab(vocab, vocab_multiple)
    ts: list[TensorSpec] = [TensorSpec("embedding.word_embeddings.weight", (vp, hidden), 0, -1, tie_embeddings)]
    for i in range(n_layers):
        p = f"decoder.layers.{i}."
        ts.append(TensorSpec(p + "input_layernorm.weight", (hidden,), None, i))
        ts.append(TensorSpec(p + "self_attention.linear_qkv.weight",
                             (n_kv_heads, (q_per_group + 2) * hd, hidden), 0, i))
        if qkv_bias:
            ts.append(TensorSpec(p + "self_attention.linear_qkv.bias", (n_kv_heads, (q_per_group + 2) * hd), 0, i))
        if qk_norm:
            ts.append(TensorSpec(p + "self_attention.q_layernorm.weight", (hd,), None, i))
            ts.append(TensorSpec(p + "self_attention.k_layernorm.weight", (hd,), None, i))
        ts.append(TensorSpec(p + "self_attention.linear_proj.weight", (hidden, n_heads * hd), 1, i))
        ts.append(TensorSpec(p + "pre_mlp_layernorm.weight", (hidden,), None, i))
        if not num_experts:
            ts.append(TensorSpec(p + "mlp.linear_fc1.weight", (2, ffn, hidden), 1, i))
            ts.append(TensorSpec(p + "mlp.linear_fc2.weight", (hidden, ffn), 1, i))
            continue
        ts.append(TensorSpec(p + "mlp.router.weight", (num_experts, hidden), None, i))
        for e in range(num_experts):
            q = f"{p}mlp.experts.local_experts.{e}."
            ts.append(TensorSpec(q + "linear_fc1.weight", (2, moe_ffn, hidden), 1, i, expert=e))
            ts.append(TensorSpec(q + "linear_fc2.weight", (hidden, moe_ffn), 1, i, expert=e))
    ts.append(TensorSpec("decoder.final_layernorm.weight", (hidden,), None, n_layers))
    if not tie_embeddings:
        ts.append(TensorSpec("output_layer.weight", (vp, hidden), 0, n_layers))
    meta = {"head_dim": hd, "tie_embeddings": tie_embeddings}
    if num_experts:
        meta.update(num_experts=num_experts, moe_ffn=moe_ffn, moe_topk=moe_topk)
    return ModelSpec(tuple(ts), n_layers, itemsize, n_heads, n_kv_heads, hidden, ffn, vocab, meta)


# Built-in sizes (numbers from the models' HF config.json files). "qwen2-70b" is Qwen2-72B.
KNOWN_MODELS: dict[str, dict] = {
    "qwen2-0.5b": dict(hidden=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn=4864, vocab=151936, tie_embeddings=True),
    "qwen2-1.5b": dict(hidden=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn=8960, vocab=151936, tie_embeddings=True),
    "qwen2-7b": dict(hidden=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn=18944, vocab=152064),
    "qwen2-14b": dict(hidden=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn=13824, vocab=152064),
    "qwen2-32b": dict(hidden=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn=27648, vocab=152064),
    "qwen2-70b": dict(hidden=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn=29568, vocab=152064),
    "qwen3-8b": dict(hidden=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn=12288, vocab=151936,
                     head_dim=128, qkv_bias=False, qk_norm=True),
    "llama3-8b": dict(hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256, qkv_bias=False),
    "llama3-70b": dict(hidden=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn=28672, vocab=128256, qkv_bias=False),
    # mixture of experts: every layer 128 experts of width 768, 8 per token (its intermediate_size
    # 6144 is a dense width no layer uses)
    "qwen3-30b-a3b": dict(hidden=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn=6144, vocab=151936,
                          head_dim=128, qkv_bias=False, qk_norm=True, num_experts=128, moe_ffn=768, moe_topk=8),
}
_ALIASES = {"qwen2-72b": "qwen2-70b", "qwen2.5-1.5b": "qwen2-1.5b", "qwen2.5-7b": "qwen2-7b",
            "qwen2.5-14b": "qwen2-14b", "qwen2.5-32b": "qwen2-32b", "qwen2.5-72b": "qwen2-70b"}


def known_model(name: str, itemsize: int = 2) -> ModelSpec:
    """The spec of a built-in size name (``qwen2-7b`` ...)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in KNOWN_MODELS:
        close = difflib.get_close_matches(key, list(KNOWN_MODELS) + list(_ALIASES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise LayoutError(f"unknown model size {name!r} (known: {', '.join(KNOWN_MODELS)}){hint}")
    return transformer_spec(itemsize=itemsize, **KNOWN_MODELS[key])


def spec_from_hf_config(cfg: dict, itemsize: int = 2, vocab_multiple: int = 128) -> ModelSpec:
    """The spec of a Qwen2/Qwen3/Qwen3-MoE/Llama HF ``config.json`` (as a dict);
    ``vocab_multiple=1`` gives the HF shapes themselves (no vocabulary padding)."""
    try:
        model_type = str(cfg.get("model_type", ""))
        moe = {}
        if model_type == "qwen3_moe":
            moe = dict(num_experts=int(cfg.get("num_experts", cfg.get("num_local_experts", 0))),
                       moe_ffn=int(cfg["moe_intermediate_size"]), moe_topk=int(cfg["num_experts_per_tok"]))
        return transformer_spec(
            hidden=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
            n_heads=int(cfg["num_attention_heads"]),
            n_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            ffn=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
            head_dim=cfg.get("head_dim"), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"), itemsize=itemsize, vocab_multiple=vocab_multiple, **moe)
    except KeyError as exc:
        raise LayoutError(f"HF config lacks {exc.args[0]!r}; expected a Qwen2/Qwen3/Llama config.json") from None

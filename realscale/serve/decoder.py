"""The embedded server's forward pass: a tensor-parallel decoder over Megatron-layout
shards, with our own contiguous KV cache.

Weights: one :class:`~realscale.serve.weights.RankWeights` per rank (a flat buffer in
the resharder's order); the tensors used here are views of it, so a weight update that
writes the buffer changes the model with nothing else to do.

Math (Megatron's tensor parallelism, without sequence parallelism; the hidden state is
replicated on every rank):

- vocab-parallel embedding: each rank looks up the ids in its vocabulary rows, zeros the
  others, and the ranks sum (``all_reduce``);
- attention: the fused QKV ``(groups, (q_per_group + 2) * head_dim, hidden)`` is split by
  whole query groups, so each rank runs its own heads and their K/V; ``linear_proj`` is
  split on its input dim and the partial outputs are summed (``all_reduce``);
- MLP: ``linear_fc1`` ``(2, ffn, hidden)`` split on ``ffn`` (gate and up rows of the same
  columns), ``linear_fc2`` on its input dim, summed (``all_reduce``);
- mixture of experts (Qwen3-MoE): the router is replicated, so every rank picks the same
  experts for a token (softmax over all experts, top-k, renormalised when the model says
  so: transformers' ``Qwen3MoeSparseMoeBlock``); each expert is split like the dense MLP
  (expert tensor parallelism = tp), the weighted expert outputs are added up locally and
  summed over ranks once (``all_reduce``). Every expert lives on every rank (no expert
  parallelism inside a server);
- output: vocab-parallel logits, concatenated over ranks (``all_gather``); padded
  vocabulary rows are cut off before sampling.

The ranks are invisible here: a :class:`TPComm` does the two collectives (no-ops for one
rank). RMSNorm is written out exactly as the HF families compute it. RoPE: the default
kind (no ``rope_scaling``; every family we load computes it alike) is :class:`DefaultRotary`
and :func:`apply_rotary`, the same arithmetic as the families' own classes (tested equal
to Qwen2's, Qwen3's and Llama's); any scaled kind uses the HF family's own rotary class and
``apply_rotary_pos_emb``, so every variant matches HF. Why not HF's always: importing a
family's config or modeling module in transformers 5 costs ~2.5 s of CPU (its docstring
decorators import the auto-model tables and the generation utilities), paid by every
server at start, beside the trainer's and the rollouts' start on the same cores. With one
rank the logits equal the HF model's to float rounding (``tests/serve/test_decoder.py``
states the bound).

KV cache memory: on CPU the buffers map anonymous memory (the kernel's zero pages,
:func:`zero_buffer`), so they are zero-filled at no cost and resident only where requests
have written: a server with 64 slots of 2,048 positions running 16 answers of a few
hundred tokens holds a few percent of it, and building the cache is free (a colocated
trainer rebuilds it every step). On GPUs it is ``torch.zeros``.

KV cache (why ours, not transformers' ``DynamicCache``): continuous batching needs
requests of different lengths to decode together and to join or leave at any step. Each
running request owns one *slot* of a preallocated ``[slots, kv_heads / tp, max_len,
head_dim]`` buffer per layer; running requests occupy slots ``0..B-1`` (a finishing
request's slot is filled by moving the last one into it), so a decode step reads the
cache as a plain view, with no per-step concatenation or padding copies.
"""

from __future__ import annotations

import math
import mmap
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from realscale.serve.weights import RankWeights, UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class TPComm:
    """The decoder's two collectives over a server's tensor-parallel group (a
    ``torch.distributed`` ProcessGroup object, gloo or NCCL); ``group=None`` is one rank."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.size = 1 if group is None else group.size()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it."""
        if self.size > 1:
            self.group.allreduce(t).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, n]`` on every rank -> ``[B, size * n]``, rank order along the last dim."""
        if self.size == 1:
            return t
        flat = t.contiguous().reshape(-1)
        out = torch.empty(self.size * flat.numel(), dtype=t.dtype, device=t.device)
        self.group._allgather_base(out, flat).wait()
        return out.view(self.size, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], self.size * t.shape[-1])


def zero_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On CPU it lies in an anonymous mapping (the tensor keeps the
    mapping alive; freeing the tensor unmaps it), whose pages the kernel provides zeroed on
    first touch: nothing is written up front and untouched pages take no memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=math.prod(shape)).view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in the HF families' order of operations (fp32 statistics, weight last)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class DefaultRotary(torch.nn.Module):
    """The default RoPE's ``(cos, sin)`` for positions ``[B, T]``: transformers'
    ``Qwen2RotaryEmbedding.forward`` (modeling_qwen2.py in transformers 5.19; Llama's and
    Qwen3's are the same) for ``rope_type: default``, in the same order of operations
    (fp32 frequencies, ``cat(freqs, freqs)``, cast to the hidden dtype last)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (rotate-half) with ``unsqueeze_dim=1``:
    ``q``/``k`` ``[B, heads, T, D]``, ``cos``/``sin`` ``[B, T, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_for(weights: RankWeights, hf_config: Callable[[], PretrainedConfig], device: torch.device
             ) -> tuple[torch.nn.Module, Callable[..., Any]]:
    """The rotary module and apply function for this model: ours for the default RoPE,
    else the HF family's (``hf_config()`` is only called then)."""
    arch = weights.arch
    if arch.rope_scaling is None:
        return DefaultRotary(arch.head_dim, arch.rope_theta).to(device), apply_rotary
    return hf_rope(hf_config(), device)


def hf_rope(hf_config: PretrainedConfig, device: torch.device) -> tuple[torch.nn.Module, Callable[..., Any]]:
    """The HF family's rotary-embedding module and ``apply_rotary_pos_emb`` for ``hf_config``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        raise UnsupportedModelError(f"no HF causal LM class for config {type(hf_config).__name__}") from None
    module = sys.modules[cls.__module__]
    prefix = cls.__name__.removesuffix("ForCausalLM")
    rotary = getattr(module, f"{prefix}RotaryEmbedding", None)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if rotary is None or apply is None:
        raise UnsupportedModelError(f"{cls.__module__} has no {prefix}RotaryEmbedding / apply_rotary_pos_emb")
    return rotary(config=hf_config).to(device), apply


class ShardedDecoder:
    """Prefill and decode of slot-indexed requests on this rank's shard of the model."""

    def __init__(self, weights: RankWeights, hf_config: Callable[[], PretrainedConfig], comm: TPComm, max_slots: int,
                 max_len: int) -> None:
        """``hf_config``: returns the model's HF config; called only for a scaled RoPE (:func:`rope_for`)."""
        arch, tp = weights.arch, weights.tp
        self.weights, self.comm = weights, comm
        self.vocab = arch.vocab_size
        self.heads, self.kv_heads = arch.num_heads // tp, arch.num_kv_heads // tp
        self.head_dim = arch.head_dim
        self.q_per_group = arch.num_heads // arch.num_kv_heads
        self.ffn = arch.ffn_hidden_size // tp
        self.moe = arch.moe
        self.moe_ffn = arch.moe.ffn_hidden_size // tp if arch.moe else 0
        self.eps = arch.norm_eps
        self.max_slots, self.max_len = max_slots, max_len
        # mixture of experts: the experts each fed token was routed to by the last forward,
        # [B, T, layers, top_k] int32 on the CPU (what a server reports for routing replay)
        self.last_routing: torch.Tensor | None = None
        self._bind(weights.tensors(), arch.num_layers, arch.tie_embeddings)
        device, dtype = weights.flat.device, weights.flat.dtype
        self.rotary, self._rope = rope_for(weights, hf_config, device)
        shape = (max_slots, self.kv_heads, max_len, self.head_dim)
        self.k_cache = [zero_buffer(shape, dtype, device) for _ in self.layers]
        self.v_cache = [zero_buffer(shape, dtype, device) for _ in self.layers]

    def _bind(self, t: dict[str, torch.Tensor], n_layers: int, tied: bool) -> None:
        """Views of the flat buffer in the shapes the math uses (no copies)."""
        self.embed = t["embedding.word_embeddings.weight"]
        self.head = self.embed if tied else t["output_layer.weight"]
        self.vocab_lo = self.weights.rows("embedding.word_embeddings.weight")[0]  # this shard's first row
        self.final_norm = t["decoder.final_layernorm.weight"]
        self.layers = []
        for i in range(n_layers):
            p = f"decoder.layers.{i}."
            qkv = t[p + "self_attention.linear_qkv.weight"]
            bias = t.get(p + "self_attention.linear_qkv.bias")
            mlp = self._bind_experts(t, p) if self.moe else {
                "fc1": t[p + "mlp.linear_fc1.weight"].reshape(-1, self.embed.shape[-1]),
                "fc2": t[p + "mlp.linear_fc2.weight"]}
            self.layers.append({
                "ln1": t[p + "input_layernorm.weight"], "ln2": t[p + "pre_mlp_layernorm.weight"],
                "qkv": qkv.reshape(-1, qkv.shape[-1]), "qkv_bias": None if bias is None else bias.reshape(-1),
                "q_norm": t.get(p + "self_attention.q_layernorm.weight"),
                "k_norm": t.get(p + "self_attention.k_layernorm.weight"),
                "proj": t[p + "self_attention.linear_proj.weight"], **mlp,
            })

    def _bind_experts(self, t: dict[str, torch.Tensor], p: str) -> dict[str, Any]:
        assert self.moe is not None
        experts = []
        for e in range(self.moe.num_experts):
            q = f"{p}mlp.experts.local_experts.{e}."
            fc1 = t[q + "linear_fc1.weight"]
            experts.append((fc1.reshape(-1, fc1.shape[-1]), t[q + "linear_fc2.weight"]))
        return {"router": t[p + "mlp.router.weight"], "experts": experts}

    @property
    def device(self) -> torch.device:
        return self.weights.flat.device

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` cached positions into slot ``dst``."""
        for k, v in zip(self.k_cache, self.v_cache):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    @torch.inference_mode()
    def forward(self, slot0: int, input_ids: torch.Tensor, start: torch.Tensor,
                last_index: torch.Tensor) -> torch.Tensor:
        """Run rows ``slot0 .. slot0+B-1``; return float32 logits at ``last_index`` ``[B, V]``.

        ``input_ids`` ``[B, T]`` are new tokens placed at positions ``start[b] + t``; rows
        shorter than ``T`` are right-padded (their padding writes cache positions that a
        later token overwrites and that no real query attends to). ``last_index[b]`` is the
        column whose logits are wanted (the row's last real token).
        """
        bsz, seqlen = input_ids.shape
        pos = start.unsqueeze(1) + torch.arange(seqlen, device=input_ids.device).unsqueeze(0)  # [B, T]
        total = int(pos.max()) + 1
        if total > self.max_len:
            raise ValueError(f"sequence of {total} tokens exceeds the KV cache length {self.max_len}")
        # Causal over each row's own history: query at p sees keys at positions <= p.
        mask = torch.arange(total, device=pos.device).view(1, 1, 1, total) <= pos.view(bsz, 1, seqlen, 1)
        hidden = self._embed(input_ids)
        cos, sin = self.rotary(hidden, pos)
        rows = torch.arange(slot0, slot0 + bsz, device=pos.device).unsqueeze(1)
        routing: list[torch.Tensor] = []
        for i, lw in enumerate(self.layers):
            x = rms_norm(hidden, lw["ln1"], self.eps)
            hidden = hidden + self._attention(i, lw, x, cos, sin, rows, pos, mask, slot0, total)
            x = rms_norm(hidden, lw["ln2"], self.eps)
            if self.moe:
                out, chosen = self._experts(lw, x)
                hidden = hidden + self.comm.all_reduce(out)
                routing.append(chosen.view(bsz, seqlen, -1))
                continue
            gate, up = F.linear(x, lw["fc1"]).split(self.ffn, dim=-1)
            hidden = hidden + self.comm.all_reduce(F.linear(F.silu(gate) * up, lw["fc2"]))
        if routing:
            self.last_routing = torch.stack(routing, dim=2).to(device="cpu", dtype=torch.int32)
        last = hidden[torch.arange(bsz, device=hidden.device), last_index]
        logits = self.comm.all_gather(F.linear(rms_norm(last, self.final_norm, self.eps), self.head))
        return logits[:, :self.vocab].float()

    def _experts(self, lw: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the mixture-of-experts MLP of ``x`` ``[B, T, H]`` (summed
        over ranks by the caller; each chosen expert runs on the tokens routed to it), and
        the chosen experts ``[B*T, top_k]`` in descending router weight."""
        assert self.moe is not None
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(F.linear(flat, lw["router"]), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.moe.topk, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            tokens, slot = (chosen == e).nonzero(as_tuple=True)
            fc1, fc2 = lw["experts"][e]
            gate, up = F.linear(flat[tokens], fc1).split(self.moe_ffn, dim=-1)
            out.index_add_(0, tokens, F.linear(F.silu(gate) * up, fc2) * weights[tokens, slot, None])
        return out.view(x.shape), chosen

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed.shape[0]
        if self.comm.size == 1:
            return F.embedding(ids, self.embed)
        local = ids - self.vocab_lo
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.clamp(0, rows - 1), self.embed).masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)

    def _attention(self, i: int, lw: dict[str, Any], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rows: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, slot0: int, total: int) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        qpg, hd = self.q_per_group, self.head_dim
        qkv = F.linear(x, lw["qkv"], lw["qkv_bias"]).view(bsz, seqlen, self.kv_heads, qpg + 2, hd)
        q = qkv[:, :, :, :qpg].reshape(bsz, seqlen, self.heads, hd)  # group g's query heads, in HF order
        k, v = qkv[:, :, :, qpg], qkv[:, :, :, qpg + 1]  # [B, T, kv_heads, D]
        if lw["q_norm"] is not None:  # Qwen3: per-head RMSNorm on q and k before rotary
            q, k = rms_norm(q, lw["q_norm"], self.eps), rms_norm(k, lw["k_norm"], self.eps)
        q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        kc, vc = self.k_cache[i], self.v_cache[i]
        kc[rows, :, pos] = k.transpose(1, 2)
        vc[rows, :, pos] = v
        keys = kc[slot0:slot0 + bsz, :, :total]
        values = vc[slot0:slot0 + bsz, :, :total]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.kv_heads != self.heads)
        return self.comm.all_reduce(F.linear(out.transpose(1, 2).reshape(bsz, seqlen, self.heads * hd), lw["proj"]))

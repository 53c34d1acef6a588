"""A batched forward pass over an HF causal LM with our own contiguous KV cache.

The HF model's own modules (embeddings, norms, projections, rotary embedding, MLP,
lm_head) do all the math; only attention's cache handling is ours, so every family
realscale knows (Qwen2, Qwen3, Llama) runs unchanged and numerics match
``model(input_ids)`` to float rounding.

Why our own cache rather than transformers' ``DynamicCache``: continuous batching needs
requests of different lengths to decode together and to join or leave at any step.
Here each running request owns one *slot* of a preallocated ``[slots, kv_heads, max_len,
head_dim]`` buffer per layer; running requests always occupy slots ``0..B-1`` (a
finishing request's slot is filled by moving the last one into it), so a decode step
reads the cache as a plain view, with no per-step concatenation or padding copies.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


class UnsupportedModelError(ValueError):
    """The model uses a feature the embedded runner does not implement."""


class KVRunner:
    """Prefill and decode for slot-indexed requests of one HF causal LM."""

    def __init__(self, model: Any, max_slots: int, max_len: int) -> None:
        cfg = model.config
        if getattr(cfg, "use_sliding_window", False):
            raise UnsupportedModelError("sliding-window attention is not supported by the embedded server")
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.max_slots = max_slots
        self.max_len = max_len
        self._rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        param = next(model.parameters())
        shape = (max_slots, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in self.layers]

    @property
    def device(self) -> torch.device:
        return self.k_cache[0].device

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
        mask = (torch.arange(total, device=pos.device).view(1, 1, 1, total) <= pos.view(bsz, 1, seqlen, 1))
        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, pos)
        rows = torch.arange(slot0, slot0 + bsz, device=pos.device).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            hidden = hidden + self._attention(i, layer.self_attn, layer.input_layernorm(hidden), cos, sin,
                                              rows, pos, mask, slot0, total)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = hidden[torch.arange(bsz, device=hidden.device), last_index]
        return self.model.lm_head(self.inner.norm(last)).float()

    def _attention(self, i: int, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rows: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, slot0: int, total: int) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = attn.q_proj(x).view(bsz, seqlen, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm on q and k before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        kc, vc = self.k_cache[i], self.v_cache[i]
        kc[rows, :, pos] = k.transpose(1, 2)
        vc[rows, :, pos] = v  # already [B, T, kv_heads, D]
        keys = kc[slot0:slot0 + bsz, :, :total]
        values = vc[slot0:slot0 + bsz, :, :total]
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                               enable_gqa=self.num_kv_heads != self.num_heads)
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, self.num_heads * self.head_dim))

"""Shared prefixes: a packed micro-batch whose sequences begin alike, run with each common
prefix once.

A GRPO group's samples share their prompt: in the default recipe 24 of each sequence's
~41 tokens, eight times over. Causal attention makes a token's hidden state depend only on
the tokens before it, so two sequences that agree on their first ``L`` tokens have the
same hidden states there; the model needs to compute them once. :func:`share_prefixes`
lays a micro-batch out as a *row* of distinct positions:

- sequences are taken in lexicographic order of their tokens, so each one's longest
  common prefix with any sequence taken before it is the one with its predecessor (a
  property of sorted strings); it reuses the predecessor's rows for those ``L`` tokens
  and adds rows for the rest. Identical sequences add no rows at all;
- every row keeps its *position* within its sequence (RoPE needs the sequence position,
  not the row index: a sample's tokens sit after other samples' in the row);
- attention (:func:`realscale.models.attention.packed_causal_attention`) runs per
  sequence over the rows of all its tokens (the shared ones and its own), and writes
  back only the rows the sequence added, so each row's output comes from one sequence
  and its gradient is counted once; keys and values of shared rows take gradient from
  every sequence that reads them;
- log-probs are needed per token of the micro-batch (the loss's alignment,
  :mod:`realscale.train.batch`): token ``k`` is predicted from the row of token ``k-1``.
  Distinct (row, target) *pairs* are computed once (a shared prompt's tokens are one pair
  each, however many samples hold them) and gathered back per token.

This is exact, not an approximation: the tests compare log-probs and gradients with the
unshared packing. It needs every layer to be per-position apart from attention, with no
dropout (true of the dense transformers here). A mixture of experts is not laid out this
way (``MegatronEngine`` packs it unshared): its routers would see each shared position
once instead of once per sample, which changes the load-balancing loss's token counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SharedRows:
    """A micro-batch of ``T`` tokens laid out as ``R <= T`` rows (module docstring).

    - ``row_ids [R]``, ``positions [R]``: the row's token and its position in its sequence;
    - ``token_rows [T]``: the row that holds each token of the micro-batch;
    - ``seq_start [S]``, ``seq_len [S]``, ``seq_shared [S]``: the sequences attention runs
      (those that added rows): their tokens are ``token_rows[start : start + len]``, and the
      first ``shared`` of them are rows another sequence owns;
    - ``pair_row [P]``, ``pair_target [P]``, ``token_pair [T]``: the distinct (row, next
      token) pairs and which one predicts each token (a sequence's first token is
      predicted by nothing: its entry points at some pair and must be masked).
    """

    row_ids: torch.Tensor
    positions: torch.Tensor
    token_rows: torch.Tensor
    seq_start: torch.Tensor
    seq_len: torch.Tensor
    seq_shared: torch.Tensor
    pair_row: torch.Tensor
    pair_target: torch.Tensor
    token_pair: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.row_ids.numel()

    @property
    def num_tokens(self) -> int:
        return self.token_rows.numel()


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m


def share_prefixes(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> SharedRows:
    """The shared-prefix layout of a packed micro-batch (``input_ids [T]``, ``cu_seqlens
    [N+1]``, no empty sequences). A pure function of the tokens: every rank that holds the
    micro-batch builds the same layout."""
    if input_ids.dim() != 1 or cu_seqlens.dim() != 1 or int(cu_seqlens[-1]) != input_ids.numel():
        raise ValueError(f"share_prefixes: input_ids [T] and cu_seqlens [N+1] ending at T expected, got shapes "
                         f"{tuple(input_ids.shape)} and {tuple(cu_seqlens.shape)}")
    ids = input_ids.detach().cpu().numpy()
    cu = cu_seqlens.detach().cpu().tolist()
    seqs = [ids[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]
    if any(s.size == 0 for s in seqs):
        raise ValueError("share_prefixes: empty sequences cannot be laid out")
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].tolist())
    token_rows = np.empty(ids.size, dtype=np.int64)
    row_ids: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    seq_start, seq_len, seq_shared = [], [], []
    rows = 0
    prev = -1
    for i in order:
        s, n = cu[i], seqs[i].size
        shared = _common_prefix(seqs[i], seqs[prev]) if prev >= 0 else 0
        if shared:
            token_rows[s:s + shared] = token_rows[cu[prev]:cu[prev] + shared]
        own = n - shared
        if own:
            token_rows[s + shared:s + n] = np.arange(rows, rows + own)
            row_ids.append(seqs[i][shared:])
            positions.append(np.arange(shared, n))
            seq_start.append(s)
            seq_len.append(n)
            seq_shared.append(shared)
            rows += own
        prev = i
    # token k (not a sequence's first) is predicted by the row of token k-1
    targets = ids
    sources = np.roll(token_rows, 1)
    firsts = np.asarray(cu[:-1], dtype=np.int64)
    sources[firsts] = token_rows[firsts]  # any pair will do: the caller masks these tokens
    vocab = int(ids.max(initial=0)) + 1
    unique, token_pair = np.unique(sources * vocab + targets, return_inverse=True)
    as_long = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64))  # noqa: E731
    return SharedRows(row_ids=as_long(np.concatenate(row_ids)), positions=as_long(np.concatenate(positions)),
                      token_rows=as_long(token_rows), seq_start=as_long(seq_start), seq_len=as_long(seq_len),
                      seq_shared=as_long(seq_shared), pair_row=as_long(unique // vocab),
                      pair_target=as_long(unique % vocab), token_pair=as_long(token_pair.reshape(-1)))

"""Shared-prefix layouts (realscale/models/shared_prefix.py) and attention over them
(realscale/models/attention.py): a micro-batch whose sequences share prefixes, run as
fewer rows, gives every token the output, and every input the gradient, that the
unshared packing gives."""

from __future__ import annotations

import math

import pytest
import torch

from realscale.models.attention import packed_causal_attention
from realscale.models.shared_prefix import share_prefixes


def _groups(seed: int = 0, prompts: int = 3, samples: int = 4, vocab: int = 7) -> list[torch.Tensor]:
    """GRPO-like sequences: a prompt each, several sampled answers (a small vocabulary, so
    answers also share starts and some repeat exactly)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (int(torch.randint(3, 9, (), generator=g)),), generator=g)
        for _ in range(samples):
            answer = torch.randint(0, vocab, (int(torch.randint(1, 6, (), generator=g)),), generator=g)
            seqs.append(torch.cat([prompt, answer]))
    seqs.append(seqs[1].clone())  # an exact repeat adds no rows
    seqs.append(seqs[2][:2].clone())  # a sequence that is a prefix of another
    return seqs


def _packed(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    return torch.cat(seqs), cu


def test_the_layout_holds_every_token_at_its_position() -> None:
    seqs = _groups()
    ids, cu = _packed(seqs)
    lay = share_prefixes(ids, cu)
    assert lay.num_tokens == ids.numel() and lay.num_rows < ids.numel()
    assert torch.equal(lay.row_ids[lay.token_rows], ids)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    assert torch.equal(lay.positions[lay.token_rows], pos)
    # each row is owned (written) by exactly one of the sequences attention runs
    owned = torch.cat([lay.token_rows[s + sh:s + n] for s, n, sh in
                       zip(lay.seq_start.tolist(), lay.seq_len.tolist(), lay.seq_shared.tolist())])
    assert torch.equal(owned.sort().values, torch.arange(lay.num_rows))
    # a row is shared only by tokens with the same history
    for k in range(ids.numel()):
        seq = int(torch.searchsorted(cu, k, right=True)) - 1
        twins = (lay.token_rows == lay.token_rows[k]).nonzero().flatten().tolist()
        for j in twins:
            other = int(torch.searchsorted(cu, j, right=True)) - 1
            assert torch.equal(ids[cu[seq]:k + 1], ids[cu[other]:j + 1])
    # token k is predicted from the row of token k-1, each (row, target) pair computed once
    firsts = set(cu[:-1].tolist())
    for k in range(ids.numel()):
        if k not in firsts:
            p = int(lay.token_pair[k])
            assert int(lay.pair_target[p]) == int(ids[k]) and int(lay.pair_row[p]) == int(lay.token_rows[k - 1])
    pairs = set(zip(lay.pair_row.tolist(), lay.pair_target.tolist()))
    assert len(pairs) == lay.pair_row.numel()


def test_a_group_prompt_is_held_once() -> None:
    prompt = [5, 1, 4, 1, 5, 9, 2, 6]
    answers = [[3], [5, 8], [9, 7, 9], [3, 2]]
    ids, cu = _packed([torch.tensor(prompt + a) for a in answers])
    lay = share_prefixes(ids, cu)
    # the prompt once, then the answers' tokens ([3] and [3, 2] share their 3)
    assert lay.num_rows == len(prompt) + 1 + 1 + 2 + 3
    assert share_prefixes(torch.tensor([1, 2, 3]), torch.tensor([0, 3])).num_rows == 3


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="empty sequences"):
        share_prefixes(torch.tensor([1, 2]), torch.tensor([0, 0, 2]))
    with pytest.raises(ValueError, match="ending at T"):
        share_prefixes(torch.tensor([1, 2]), torch.tensor([0, 3]))


@pytest.mark.parametrize("hq,hk,pad", [(4, 2, 0), (2, 2, 3)])
def test_attention_over_the_layout_equals_unshared_values_and_gradients(hq: int, hk: int, pad: int) -> None:
    """Rows computed once stand for every token that holds them: the outputs gathered per
    token equal the unshared attention's, and so do the gradients of q, k, v gathered to
    rows (a shared row's gradient is the sum over the tokens holding it). ``pad``: sequence
    parallelism's padding rows after the layout's."""
    seqs = _groups(seed=2)
    ids, cu = _packed(seqs)
    lay = share_prefixes(ids, cu)
    g = torch.Generator().manual_seed(3)
    d, r = 8, lay.num_rows
    # per-row inputs (as a model's projections of the rows would be), then per-token copies
    q, k, v = (torch.randn(r + pad, h, d, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (hq, hk, hk))
    rows = lay.token_rows
    want = packed_causal_attention(q[rows], k[rows], v[rows], cu, 1 / math.sqrt(d))
    got = packed_causal_attention(q, k, v, torch.tensor([0, r, r + pad] if pad else [0, r]), 1 / math.sqrt(d),
                                  shared=lay)
    torch.testing.assert_close(got[rows], want, rtol=0, atol=1e-12)
    weights = torch.randn(ids.numel(), hq, d, generator=g, dtype=torch.float64)
    # the loss on tokens: a shared row's output is read once per token holding it
    got_grads = torch.autograd.grad((got[rows] * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

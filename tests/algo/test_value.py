"""The clipped value loss against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from realscale.algo.value import value_loss

V = [0.5, 0.0, 1.0, 0.3]
OLD = [0.2, 0.0, 0.5, 0.3]
RET = [1.0, 1.0, 0.0, 0.3]
MASK = [1, 1, 1, 0]


def test_clipped_value_loss_by_hand() -> None:
    v = torch.tensor(V, requires_grad=True)
    loss, stats = value_loss(v, torch.tensor(OLD), torch.tensor(RET), torch.tensor(MASK), clip=0.2)
    # token 0: v moved 0.3 > 0.2 from v_old: clipped value 0.4, (0.4-1)^2 = 0.36 > (0.5-1)^2 = 0.25
    # token 1: 1.0; token 2: clipped 0.7 gives 0.49 < 1.0, so 1.0; token 3 is masked out
    assert loss.item() == pytest.approx(0.5 * (0.36 + 1.0 + 1.0) / 3)
    assert stats["value_clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["value_error"].item() == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    loss.backward()
    # the clipped branch of token 0 is flat in v; tokens 1, 2: (v - R) / 3
    assert v.grad.tolist() == pytest.approx([0.0, -1 / 3, 1 / 3, 0.0])


def test_unclipped_and_normalizer() -> None:
    args = (torch.tensor(V), torch.tensor(OLD), torch.tensor(RET), torch.tensor(MASK))
    assert value_loss(*args, clip=0.0)[0].item() == pytest.approx(0.5 * (0.25 + 1.0 + 1.0) / 3)
    # a global normalizer (tokens over every micro-batch and rank) replaces the local count
    assert value_loss(*args, clip=0.0, normalizer=9.0)[0].item() == pytest.approx(0.5 * 2.25 / 9)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="clip"):
        value_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2), clip=-1.0)
    with pytest.raises(ValueError, match="returns"):
        value_loss(torch.zeros(2), torch.zeros(2), torch.zeros(3), torch.ones(2))

"""The (decoupled) PPO policy loss on packed tokens.

Decoupled PPO (AReaL, arXiv 2505.24298, eq. 5) separates the *behaviour* policy that
sampled a token (``logp_behav``, from the generation server, possibly several versions
old) from the *proximal* policy the update is clipped around (``logp_prox``, recomputed
by the trainer before the update)::

    r = exp(logp - logp_prox)                      (gradient flows here)
    w = exp(logp_prox - logp_behav)                (detached; capped)
    l = max(-A r, -A clip(r, 1 - eps, 1 + eps_high))
    loss = sum_t coef_t * w_t * l_t                (coef: mask and aggregation, below)

Standard PPO is the special case ``logp_prox = logp_behav`` (pass ``logp_prox=None``);
then ``w = 1`` and the result is bit-for-bit the same as passing equal tensors.

Choices and where they come from:

- Asymmetric clip (``eps_clip_high``, DAPO's clip-higher) and dual clip (Ye et al.,
  arXiv 1912.09729: for A < 0 the loss is bounded by ``-c A``).
- The cap on ``w``: ``mask`` drops tokens with ``w > cap`` from the numerator but keeps
  them in the default denominator (as AReaL does, so that dropping tokens does not
  inflate the others' gradients); ``clamp`` uses ``min(w, cap)``.
- Aggregation: ``token_mean`` divides the masked sum by a token count;
  ``seq_mean_token_mean`` averages tokens within each sequence, then sequences.
  Both are written as one per-token coefficient, so the loss is always a weighted sum.
- ``normalizer``: the denominator (tokens for token_mean, sequences for
  seq_mean_token_mean). The trainer passes the count over the *whole global batch*
  (all micro-batches, all data-parallel ranks; see :func:`loss_normalizer`), so that
  summing micro-batch losses (and their gradients) gives exactly the batch mean.
  Left out, it is this call's own count.

Speed: on the CPU the surrogate runs through csrc/ppo_loss.cpp, which reads each token
once and produces the loss, the per-token gradient and the statistics together; the
backward pass is one multiply. Elsewhere (GPU, or no build) the torch path does the same
maths in elementwise ops, and still computes the gradient in the forward pass (it is
elementwise: ``-A r`` where the unclipped branch is active, else 0) rather than having
autograd replay ~15 saved ops. The two paths agree (tests/algo/test_losses.py); see
benchmarks/bench_ppo_loss.py for the timings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from realscale import kernels
from realscale.algo.kl import ESTIMATORS, kl_penalty
from realscale.algo.packed import check_1d, check_cu_seqlens, check_same_device, seq_ids, segment_sum

if TYPE_CHECKING:
    from realscale.config import AlgoConfig

AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
CAP_MODES = ("mask", "clamp")


class _ClippedSurrogate(torch.autograd.Function):
    """``sum_t coef_t * max(-A r, -A clip(r))`` (with dual clip) and its gradient w.r.t. logp."""

    @staticmethod
    def forward(ctx: Any, logp: Tensor, logp_prox: Tensor, adv: Tensor, coef: Tensor, valid: Tensor,
                lo: float, hi: float, dual: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # Masked-out tokens get r = 1 so that garbage log-probs there (padding, -inf) can't
        # turn 0 * inf into NaN.
        r = torch.exp(torch.where(valid, logp - logp_prox, 0.0))
        neg_adv = -adv
        l_unclipped = neg_adv * r
        l_clipped = neg_adv * r.clamp(lo, hi)
        active = l_unclipped >= l_clipped  # the gradient flows through the unclipped term
        per_token = torch.maximum(l_unclipped, l_clipped)
        if dual > 0.0:
            bound = neg_adv * dual  # -c A, positive where A < 0
            dual_hit = (adv < 0) & (per_token > bound)
            per_token = torch.where(dual_hit, bound, per_token)
            active &= ~dual_hit
        else:
            dual_hit = None
        loss = torch.dot(coef, per_token)
        ctx.save_for_backward(torch.where(active, coef * l_unclipped, 0.0))
        # r and the masks go out for the statistics (not differentiable).
        out_dual = dual_hit if dual_hit is not None else torch.zeros((), dtype=torch.bool, device=r.device)
        ctx.mark_non_differentiable(r, active, out_dual)
        return loss, r, active, out_dual

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        (grad_logp,) = ctx.saved_tensors
        return grad_logp * grad_loss, None, None, None, None, None, None, None


def _as_float(x: Tensor) -> Tensor:
    """float32 for half types (the loss math wants the range), otherwise unchanged."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _check_loss_inputs(logp: Tensor, logp_behav: Tensor, advantages: Tensor, loss_mask: Tensor,
                       logp_prox: Tensor | None, eps_clip: float, eps_clip_high: float, dual_clip: float,
                       imp_weight_cap: float, imp_weight_mode: str, agg: str, cu_seqlens: Tensor | None,
                       normalizer: float | Tensor | None, logp_ref: Tensor | None, kl_coef: float,
                       kl_estimator: str) -> None:
    check_1d("logp", logp, floating=True)
    n = logp.numel()
    check_1d("logp_behav", logp_behav, n, floating=True)
    check_1d("advantages", advantages, n, floating=True)
    check_1d("loss_mask", loss_mask, n)
    if logp_prox is not None:
        check_1d("logp_prox", logp_prox, n, floating=True)
    if logp_ref is not None:
        check_1d("logp_ref", logp_ref, n, floating=True)
    check_same_device(logp=logp, logp_behav=logp_behav, advantages=advantages, loss_mask=loss_mask,
                      logp_prox=logp_prox, logp_ref=logp_ref)
    if not 0.0 < eps_clip < 1.0:
        raise ValueError(f"eps_clip: must lie in (0, 1), got {eps_clip!r}")
    if not eps_clip_high > 0.0:
        raise ValueError(f"eps_clip_high: must be > 0, got {eps_clip_high!r}")
    if dual_clip and not dual_clip > 1.0:
        raise ValueError(f"dual_clip: must be > 1 (or 0 for off), got {dual_clip!r}")
    if imp_weight_cap < 0:
        raise ValueError(f"imp_weight_cap: must be >= 0 (0: no cap), got {imp_weight_cap!r}")
    if imp_weight_mode not in CAP_MODES:
        raise ValueError(f"imp_weight_mode: {imp_weight_mode!r} is not one of {', '.join(CAP_MODES)}")
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg: {agg!r} is not one of {', '.join(AGGREGATIONS)}")
    if agg == "seq_mean_token_mean":
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: required when agg='seq_mean_token_mean'")
        check_cu_seqlens(cu_seqlens, n)
    if isinstance(normalizer, (int, float)) and not normalizer > 0:
        raise ValueError(f"normalizer: must be > 0, got {normalizer!r}")
    if isinstance(normalizer, Tensor) and normalizer.numel() != 1:
        raise ValueError(f"normalizer: expected a scalar, got shape {tuple(normalizer.shape)}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef: must be >= 0, got {kl_coef!r}")
    if kl_coef > 0 and logp_ref is None:
        raise ValueError("logp_ref: required when kl_coef > 0")
    if kl_estimator not in ESTIMATORS:
        raise ValueError(f"kl_estimator: {kl_estimator!r} is not one of {', '.join(ESTIMATORS)}")


def loss_normalizer(loss_mask: Tensor, cu_seqlens: Tensor | None = None, agg: str = "token_mean") -> Tensor:
    """This batch's share of the denominator: masked tokens (token_mean) or sequences with
    at least one masked token (seq_mean_token_mean). Sum it over every micro-batch and
    data-parallel rank of a step and pass the total as ``ppo_loss(normalizer=...)``."""
    check_1d("loss_mask", loss_mask)
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg: {agg!r} is not one of {', '.join(AGGREGATIONS)}")
    m = loss_mask.to(torch.bool)
    if agg == "token_mean":
        return m.sum().double()
    if cu_seqlens is None:
        raise ValueError("cu_seqlens: required when agg='seq_mean_token_mean'")
    check_cu_seqlens(cu_seqlens, m.numel())
    return (segment_sum(m.double(), cu_seqlens.to(m.device, torch.long)) > 0).sum().double()


def _token_coef(valid: Tensor, agg: str, cu_seqlens: Tensor | None, normalizer: float | Tensor | None,
                dtype: torch.dtype) -> Tensor:
    """Per-token weight of the aggregation: the loss is ``sum_t coef_t * w_t * l_t``."""
    m = valid.to(dtype)
    if agg == "token_mean":
        denom = m.sum().clamp(min=1) if normalizer is None else normalizer
        return m / denom
    cu = cu_seqlens.to(valid.device, torch.long)  # type: ignore[union-attr]
    per_seq = segment_sum(m, cu)
    if normalizer is None:
        normalizer = (per_seq > 0).sum().clamp(min=1)
    per_seq_scale = 1.0 / (per_seq.clamp(min=1) * normalizer)
    return m * per_seq_scale[seq_ids(cu, m.numel())]


def _behav_weight(logp_prox: Tensor, logp_behav: Tensor, valid: Tensor, cap: float,
                  mode: str) -> tuple[Tensor, Tensor]:
    """(w, capped) with w = exp(prox - behav) on valid tokens (0 elsewhere, 0 where masked out)."""
    log_w = torch.where(valid, logp_prox - logp_behav, 0.0)
    w = torch.exp(log_w)
    # A non-finite log-ratio (-inf - -inf) means a broken log-prob: drop that token.
    w = torch.where(torch.isfinite(w), w, 0.0)
    if cap > 0:
        capped = valid & (w > cap)
        w = torch.where(capped, 0.0, w) if mode == "mask" else w.clamp(max=cap)
    else:
        capped = torch.zeros_like(valid)
    return torch.where(valid, w, 0.0), capped


def ppo_loss(logp: Tensor, logp_behav: Tensor, advantages: Tensor, loss_mask: Tensor, *,
             logp_prox: Tensor | None = None, eps_clip: float = 0.2, eps_clip_high: float | None = None,
             dual_clip: float = 0.0, imp_weight_cap: float = 0.0, imp_weight_mode: str = "mask",
             agg: str = "token_mean", cu_seqlens: Tensor | None = None,
             normalizer: float | Tensor | None = None, logp_ref: Tensor | None = None, kl_coef: float = 0.0,
             kl_estimator: str = "k3") -> tuple[Tensor, dict[str, Tensor]]:
    """The (decoupled) PPO loss and detached statistics; see the module docstring.

    All token tensors are 1-D packed and of one length. ``logp`` carries the gradient;
    the others are data (detached here). ``logp_prox=None`` is standard PPO. With
    ``kl_coef > 0`` the loss adds ``kl_coef * KL(logp || logp_ref)`` aggregated the same
    way (not weighted by w).

    Statistics (0-d tensors, means over this call's valid tokens, no device sync):
    ``pg_loss``, ``kl``, ``clip_frac``, ``dual_clip_frac``, ``ratio_mean``,
    ``approx_kl`` (mean of logp_prox - logp), ``behav_imp_weight_mean``,
    ``behav_capped_frac``, ``behav_kl`` (mean of logp_prox - logp_behav), ``n_tokens``.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    _check_loss_inputs(logp, logp_behav, advantages, loss_mask, logp_prox, eps_clip, eps_high, dual_clip,
                       imp_weight_cap, imp_weight_mode, agg, cu_seqlens, normalizer, logp_ref, kl_coef,
                       kl_estimator)
    logp = _as_float(logp)
    dtype = logp.dtype
    valid = loss_mask.to(torch.bool)
    behav = logp_behav.detach().to(dtype)
    adv = advantages.detach().to(dtype)
    prox = behav if logp_prox is None else logp_prox.detach().to(dtype)
    mod = kernels.load("ppo_loss") if logp.device.type == "cpu" else None
    if mod is not None:
        pg_loss, stats = _fused_surrogate(mod, logp, prox, None if logp_prox is None else behav, adv, valid, agg,
                                          cu_seqlens, normalizer, eps_clip, eps_high, dual_clip, imp_weight_cap,
                                          imp_weight_mode)
    else:
        pg_loss, stats = _torch_surrogate(logp, prox, None if logp_prox is None else behav, adv, valid, agg,
                                          cu_seqlens, normalizer, eps_clip, eps_high, dual_clip, imp_weight_cap,
                                          imp_weight_mode)
    loss = pg_loss
    if kl_coef > 0:
        # Same aggregation as the surrogate, not weighted by w.
        coef = _token_coef(valid, agg, cu_seqlens, normalizer, dtype)
        kl = torch.dot(coef, torch.where(valid, kl_penalty(logp, logp_ref, kl_estimator), 0.0))  # type: ignore[arg-type]
        loss = loss + kl_coef * kl
        stats["kl"] = kl.detach()
    return loss, stats


def _torch_surrogate(logp: Tensor, prox: Tensor, behav: Tensor | None, adv: Tensor, valid: Tensor, agg: str,
                     cu_seqlens: Tensor | None, normalizer: float | Tensor | None, eps_clip: float,
                     eps_high: float, dual_clip: float, cap: float, mode: str) -> tuple[Tensor, dict[str, Tensor]]:
    """The surrogate in torch ops (any device): the reference for the fused CPU kernel."""
    coef = _token_coef(valid, agg, cu_seqlens, normalizer, logp.dtype)
    if behav is None:
        pg_coef, w, capped = coef, None, None
    else:
        w, capped = _behav_weight(prox, behav, valid, cap, mode)
        pg_coef = coef * w
    pg_loss, ratio, active, dual_hit = _ClippedSurrogate.apply(
        logp, prox, adv, pg_coef, valid, 1.0 - eps_clip, 1.0 + eps_high, float(dual_clip))
    behav_ = prox if behav is None else behav
    return pg_loss, _loss_stats(logp, prox, behav_, valid, ratio, active, dual_hit, w, capped, pg_loss)


class _FusedSurrogate(torch.autograd.Function):
    """The surrogate through csrc/ppo_loss.cpp: one pass gives loss, gradient and statistics."""

    @staticmethod
    def forward(ctx: Any, logp: Tensor, mod: Any, args: tuple, per_valid: bool) -> tuple[Tensor, Tensor]:
        grad, sums = mod.ppo_loss_fwd(logp.detach(), *args)
        # per_valid: the kernel summed with coefficient 1 and counted the valid tokens on
        # the way; dividing here (and in backward's one multiply) saves a counting pass.
        ctx.scale = 1.0 / max(float(sums[_VALID]), 1.0) if per_valid else 1.0
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(sums)
        return (sums[_LOSS] * ctx.scale).to(logp.dtype), sums

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, _: Any) -> tuple[Tensor | None, None, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * (grad_loss * ctx.scale), None, None, None


# Positions in the kernel's statistics vector (csrc/ppo_loss.cpp, enum Stat).
_LOSS, _VALID, _CLIPPED, _DUAL, _RATIO, _AKL, _W, _CAPPED, _BKL = range(9)


def _fused_surrogate(mod: Any, logp: Tensor, prox: Tensor, behav: Tensor | None, adv: Tensor, valid: Tensor,
                     agg: str, cu_seqlens: Tensor | None, normalizer: float | Tensor | None, eps_clip: float,
                     eps_high: float, dual_clip: float, cap: float, mode: str) -> tuple[Tensor, dict[str, Tensor]]:
    per_valid = agg == "token_mean" and normalizer is None
    if agg == "token_mean":  # a scalar coefficient: no per-token tensor to build or read
        coef_t, coef = None, 1.0 if normalizer is None else 1.0 / float(normalizer)
    else:
        coef_t, coef = _token_coef(valid, agg, cu_seqlens, normalizer, logp.dtype), 0.0
    args = (prox, behav, adv, valid, coef_t, coef, 1.0 - eps_clip, 1.0 + eps_high, float(dual_clip),
            float(cap) if behav is not None else 0.0, mode == "clamp")
    pg_loss, sums = _FusedSurrogate.apply(logp, mod, args, per_valid)
    inv = 1.0 / max(float(sums[_VALID]), 1.0)
    dt = logp.dtype
    stats = {
        "pg_loss": pg_loss.detach(),
        "clip_frac": (sums[_CLIPPED] * inv).to(dt),
        "dual_clip_frac": (sums[_DUAL] * inv).to(dt),
        "ratio_mean": (sums[_RATIO] * inv).to(dt),
        "approx_kl": (sums[_AKL] * inv).to(dt),
        "n_tokens": sums[_VALID].to(dt),
    }
    if behav is not None:
        stats["behav_imp_weight_mean"] = (sums[_W] * inv).to(dt)
        stats["behav_capped_frac"] = (sums[_CAPPED] * inv).to(dt)
        stats["behav_kl"] = (sums[_BKL] * inv).to(dt)
    return pg_loss, stats


@torch.no_grad()
def _loss_stats(logp: Tensor, prox: Tensor, behav: Tensor, valid: Tensor, ratio: Tensor, active: Tensor,
                dual_hit: Tensor, w: Tensor | None, capped: Tensor | None, pg_loss: Tensor) -> dict[str, Tensor]:
    n_valid = valid.sum()
    inv = 1.0 / n_valid.clamp(min=1).to(logp.dtype)
    n_total = valid.numel()
    # Masked-out tokens have r = 1, so they are never clipped: sums over all tokens are
    # sums over valid ones, without another masking pass.
    clipped = (n_total - active.sum()) - (dual_hit.sum() if dual_hit.dim() else 0)
    stats = {
        "pg_loss": pg_loss.detach(),
        "clip_frac": clipped.to(logp.dtype) * inv,
        "dual_clip_frac": dual_hit.sum().to(logp.dtype) * inv,
        "ratio_mean": (ratio.sum() - (n_total - n_valid)) * inv,
        "approx_kl": torch.where(valid, prox - logp.detach(), 0.0).sum() * inv,
        "n_tokens": n_valid.to(logp.dtype),
    }
    if w is not None and capped is not None:
        stats["behav_imp_weight_mean"] = w.sum() * inv
        stats["behav_capped_frac"] = capped.sum().to(logp.dtype) * inv
        stats["behav_kl"] = torch.where(valid, prox - behav, 0.0).sum() * inv
    return stats


def loss_kwargs_from_config(cfg: AlgoConfig) -> dict[str, Any]:
    """The :func:`ppo_loss` keyword arguments an :class:`~realscale.config.AlgoConfig` selects.

    (``logp_prox`` is the caller's business: pass it when ``cfg.decoupled``.)
    """
    return {
        "eps_clip": float(cfg.eps_clip),
        "eps_clip_high": float(cfg.eps_clip_high),
        "dual_clip": float(cfg.dual_clip),
        "imp_weight_cap": float(cfg.behav_imp_weight_cap) if cfg.decoupled else 0.0,
        "imp_weight_mode": cfg.behav_imp_weight_mode,
        "agg": cfg.loss_agg,
        "kl_coef": float(cfg.kl_coef),
        "kl_estimator": cfg.kl_estimator,
    }


__all__ = ["AGGREGATIONS", "CAP_MODES", "loss_kwargs_from_config", "loss_normalizer", "ppo_loss"]

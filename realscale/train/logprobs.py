"""Per-token log-probs (and entropy) of given tokens, vocab-parallel and in token chunks.

The trainer recomputes proximal / current log-probs of packed, unpadded sequences with the
generation server's convention (:data:`realscale.algo.sampling.LOGPROB_CONVENTION`):

    logprob(token) = log_softmax(logits / T)[token]   over the true vocabulary, in fp32

Under tensor parallelism megatron's output layer (``ColumnParallelLinear`` with
``parallel_output=True``) leaves each TP rank with a vocab shard of the logits,
``logits[..., r*V/tp:(r+1)*V/tp]`` of the *padded* vocabulary (megatron pads V to a
multiple of ``make_vocab_size_divisible_by * tp``). Nothing here gathers the vocabulary:
every rank reduces its shard, and two collectives per chunk (a MAX, then one SUM over a
stacked ``[3, chunk]`` tensor) give the global log-sum-exp, the target logit and
``sum p*z``. Padded columns (ids >= ``true_vocab_size``) are sliced off before the
softmax, so they never take probability mass and get zero gradient.

Two entry points, each with its own ``torch.autograd.Function``:

* :func:`vocab_parallel_logprobs` takes the logits shard ``[T, V/tp]``. It never holds more
  than one fp32 ``[chunk, V/tp]`` block (plus one more in backward); the backward
  recomputes each chunk's softmax from the saved per-token log-sum-exp instead of saving
  fp32 probabilities.
* :func:`logprobs_from_hidden` takes the final hidden states ``[T, H]`` and the output
  weight shard ``[V/tp, H]`` and computes the logits chunk by chunk inside, so the
  ``[T, V/tp]`` logits never exist, in any dtype, in forward or backward. This is the
  memory win for long sequences (see ``benchmarks/bench_logprob_memory.py``).

Gradients, with z = logits / T, p = softmax(z) over the global vocabulary:

    d logprob / d z = onehot(target) - p
    d entropy / d z = -p * (z - E_p[z])          (entropy H = logsumexp(z) - E_p[z])

and d/d logits = (d/d z) / T. Both need only the per-token scalars ``lse`` and ``E_p[z]``
(saved, [T] each) besides the recomputed chunk, so the backward needs no communication:
every TP rank computes the exact gradient of its own shard, because the outputs (and so
the upstream gradients) are identical on all TP ranks.

The hidden-state gradient is *partial* under TP (each rank only sees its vocab shard's
contribution); see :func:`logprobs_from_hidden` for how the caller completes it.

:func:`reference_logprobs` is the straightforward version (all-gather the full logits,
``log_softmax``) that the tests and the benchmark compare against.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from realscale.algo.packed import check_1d, check_cu_seqlens
from realscale.algo.sampling import token_logprobs
from realscale.parallel.device import comm_empty, group_backend, to_comm

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps the import lazy and None allowed


# --------------------------------------------------------------------------- validation


def _check_common(n_tokens: int, targets: Tensor, temperature: float, vocab_start: int, shard_size: int,
                  true_vocab_size: int, tp_group: ProcessGroup | None, chunk_tokens: int) -> None:
    """Everything both entry points require; raises with the offending argument's name."""
    if not isinstance(targets, Tensor):
        raise TypeError(f"targets: expected a torch.Tensor of token ids, got {type(targets).__name__}")
    if targets.dim() != 1 or targets.numel() != n_tokens:
        raise ValueError(f"targets: expected shape ({n_tokens},) (one id per token row), got {tuple(targets.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets: expected an integer tensor of token ids, got {targets.dtype}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        # Greedy sampling reports log-probs at T = 1 (sampling.effective_temperature): callers
        # map it before calling, so a 0 here is a bug, not "greedy".
        raise ValueError(f"temperature: must be finite and > 0 (map greedy T=0 to 1 with "
                         f"sampling.effective_temperature), got {temperature}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens: expected a positive int, got {chunk_tokens!r}")
    if isinstance(true_vocab_size, bool) or not isinstance(true_vocab_size, int) or true_vocab_size <= 0:
        raise ValueError(f"true_vocab_size: expected a positive int, got {true_vocab_size!r}")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start: expected a non-negative int, got {vocab_start!r}")
    rank, world = _group_rank_world(tp_group)
    if vocab_start != rank * shard_size:
        raise ValueError(f"vocab_start: rank {rank} of the TP group holds a shard of {shard_size} columns, so its "
                         f"vocab_start must be {rank * shard_size}, got {vocab_start}")
    if true_vocab_size > world * shard_size:
        raise ValueError(f"true_vocab_size: {true_vocab_size} exceeds the padded vocabulary "
                         f"{world} ranks x {shard_size} columns = {world * shard_size}")
    if n_tokens:
        # One device sync; a wrong id would otherwise silently read another token's logit
        # (or none at all, giving log-prob = -lse).
        lo, hi = (int(v) for v in torch.aminmax(targets))
        if lo < 0 or hi >= true_vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"targets: token id {bad} is outside the vocabulary [0, {true_vocab_size})")


def _group_rank_world(tp_group: ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) in the TP group; ``None`` means no TP: the shard is the whole vocabulary."""
    if tp_group is None:
        return 0, 1

    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _check_same_device(**tensors: Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError("tensors must be on one device, got " + ", ".join(f"{k} on {v}" for k, v in devices.items()))


# --------------------------------------------------------------------------- chunk math


def _all_reduce(x: Tensor, op: str, group: ProcessGroup | None) -> None:
    """In-place all_reduce over the TP group; a no-op without one."""
    if group is None:
        return

    if dist.get_world_size(group) > 1:
        t = to_comm(x, group_backend(group))  # ``x`` itself: the logits' device is the group's
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        if t is not x:
            x.copy_(t)


def _scaled_fp32(x: Tensor, temperature: float, fresh: bool = False) -> Tensor:
    """``x / T`` in an fp32 tensor we own: later steps work on it in place, so a view of the
    caller's logits is copied, while a ``fresh`` block (a matmul result) is reused."""
    z = x.float() if fresh else x.to(torch.float32, copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def _local_targets(targets: Tensor, vocab_start: int, n_valid: int) -> tuple[Tensor, Tensor]:
    """Column of each target in this shard (clamped into range) and whether this rank owns it."""
    local = targets.long() - vocab_start
    owned = (local >= 0) & (local < n_valid)
    return local.clamp(0, max(n_valid - 1, 0)), owned


def _chunk_forward(z: Tensor, local: Tensor, owned: Tensor, with_entropy: bool,
                   group: ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor]:
    """Global (lse, target z, E_p[z]) of a chunk from this rank's scaled logits ``z`` [c, n_valid].

    ``E_p[z]`` is zeros when entropy is not asked for. Two collectives: the max, then one
    stacked SUM, so the message count does not grow with the number of statistics.
    """
    c, n_valid = z.shape
    if n_valid == 0:  # a shard made only of vocab padding still takes part in the collectives
        zmax = torch.full((c,), -math.inf, dtype=torch.float32, device=z.device)
    else:
        zmax = z.amax(dim=1)
    _all_reduce(zmax, "MAX", group)
    stats = torch.zeros(3, c, dtype=torch.float32, device=z.device)
    if n_valid:
        e = torch.exp(z - zmax.unsqueeze(1))
        stats[0] = e.sum(dim=1)
        stats[1] = torch.where(owned, z.gather(1, local.unsqueeze(1)).squeeze(1), 0.0)
        if with_entropy:
            stats[2] = torch.einsum("ij,ij->i", e, z)  # sum exp(z - max) * z, normalised below
        del e
    _all_reduce(stats, "SUM", group)
    sumexp, z_target, ez_unnorm = stats
    lse = zmax + torch.log(sumexp)
    ez = ez_unnorm / sumexp if with_entropy else torch.zeros_like(lse)
    return lse, z_target, ez


def _chunk_grad_z(z: Tensor, lse: Tensor, ez: Tensor, local: Tensor, owned: Tensor,
                  g_lp: Tensor | None, g_h: Tensor | None) -> Tensor:
    """d loss / d z for one chunk, overwriting ``z`` (a fresh recomputed block) to keep
    memory at two fp32 chunk blocks: ``-p * (g_lp + g_h * (z - E[z])) + onehot * g_lp``."""
    if g_h is not None:
        p = torch.exp(z - lse.unsqueeze(1))
        coef = z.sub_(ez.unsqueeze(1)).mul_(g_h.unsqueeze(1))
        if g_lp is not None:
            coef.add_(g_lp.unsqueeze(1))
        grad = coef.mul_(p).neg_()
        del p
    else:
        # g_lp is not None here (the caller skips chunks without gradient); p overwrites z
        grad = z.sub_(lse.unsqueeze(1)).exp_().mul_(-g_lp.unsqueeze(1))
    if g_lp is not None and grad.shape[1]:
        # Rows whose target lives on another rank add 0 (a scatter, not a nonzero(): no device sync).
        grad.scatter_add_(1, local.unsqueeze(1), torch.where(owned, g_lp, 0.0).unsqueeze(1))
    return grad


def _grad_slices(grads: tuple[Tensor | None, Tensor | None], i: int, j: int,
                 temperature: float) -> tuple[Tensor | None, Tensor | None]:
    """Upstream gradients of chunk [i, j), folded with 1/T (d z / d logits)."""
    return tuple(None if g is None else g[i:j].float() / temperature for g in grads)  # type: ignore[return-value]


# --------------------------------------------------------------------------- from logits


class _VocabParallelLogprobs(torch.autograd.Function):
    """Autograd wrapper of the chunked vocab-parallel log-prob / entropy over a logits shard."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float, vocab_start: int,
                n_valid: int, group: ProcessGroup | None, chunk: int, with_entropy: bool) -> tuple[Tensor, Tensor]:
        n = logits.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse_all = torch.empty_like(logprobs)
        ez_all = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            z = _scaled_fp32(logits[i:j, :n_valid], temperature)
            local, owned = _local_targets(targets[i:j], vocab_start, n_valid)
            lse, zt, ez = _chunk_forward(z, local, owned, with_entropy, group)
            logprobs[i:j] = zt - lse
            lse_all[i:j] = lse
            if with_entropy:
                ez_all[i:j] = ez
        entropy = lse_all - ez_all if with_entropy else logprobs.new_empty(0)
        ctx.save_for_backward(logits, targets, lse_all, ez_all)
        ctx.args = (temperature, vocab_start, n_valid, chunk, with_entropy)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_h: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, targets, lse_all, ez_all = ctx.saved_tensors
        temperature, vocab_start, n_valid, chunk, with_entropy = ctx.args
        g_h = g_h if with_entropy else None
        if not ctx.needs_input_grad[0]:
            return (None,) * 8
        grad = torch.zeros_like(logits)  # padded vocab columns keep a zero gradient
        for i in range(0, logits.shape[0], chunk):
            j = min(i + chunk, logits.shape[0])
            glp, gh = _grad_slices((g_lp, g_h), i, j, temperature)
            if (glp is None and gh is None) or n_valid == 0:
                continue
            z = _scaled_fp32(logits[i:j, :n_valid], temperature)
            local, owned = _local_targets(targets[i:j], vocab_start, n_valid)
            ez = ez_all[i:j] if with_entropy else None
            grad[i:j, :n_valid] = _chunk_grad_z(z, lse_all[i:j], ez, local, owned, glp, gh)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs(logits_shard: Tensor, targets: Tensor, *, temperature: float = 1.0,
                            vocab_start: int, true_vocab_size: int, tp_group: ProcessGroup | None = None,
                            chunk_tokens: int = 1024, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[T]`` (fp32) of ``targets`` under this rank's logits shard, and optionally the
    entropy ``[T]`` of the temperature-scaled distribution (differentiable too).

    ``logits_shard``: ``[T, V/tp]``, any float dtype, columns ``vocab_start ..
    vocab_start + V/tp`` of the padded vocabulary (megatron's ``parallel_output=True``).
    ``targets``: ``[T]`` global token ids, all below ``true_vocab_size``. ``tp_group``: the
    tensor-parallel group (``parallel_state.get_tensor_model_parallel_group()``); ``None``
    means the shard is the whole vocabulary and no collective runs. Every rank of the group
    must call with the same ``T``, ``targets``, ``temperature`` and ``chunk_tokens``.
    Gradients flow to ``logits_shard``; the backward builds a ``[T, V/tp]`` gradient in the
    logits' dtype (as autograd must) but only two fp32 ``[chunk, V/tp]`` working blocks.
    """
    if not isinstance(logits_shard, Tensor) or logits_shard.dim() != 2 or not logits_shard.is_floating_point():
        raise ValueError("logits_shard: expected a floating-point [T, V/tp] tensor, got "
                         + (f"shape {tuple(logits_shard.shape)} {logits_shard.dtype}"
                            if isinstance(logits_shard, Tensor) else type(logits_shard).__name__))
    n, shard = logits_shard.shape
    _check_common(n, targets, temperature, vocab_start, shard, true_vocab_size, tp_group, chunk_tokens)
    _check_same_device(logits_shard=logits_shard, targets=targets)
    n_valid = max(0, min(shard, true_vocab_size - vocab_start))
    lp, ent = _VocabParallelLogprobs.apply(logits_shard, targets, float(temperature), vocab_start, n_valid,
                                           tp_group, chunk_tokens, with_entropy)
    return lp, (ent if with_entropy else None)


# --------------------------------------------------------------------------- from hidden states


class _LogprobsFromHidden(torch.autograd.Function):
    """Autograd wrapper that forms each chunk's logits from hidden states and the weight shard."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, vocab_start: int,
                n_valid: int, group: ProcessGroup | None, chunk: int, with_entropy: bool) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        w = weight[:n_valid]  # padded vocab rows never enter the softmax
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty_like(logprobs)
        ez_all = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            z = _scaled_fp32(hidden[i:j] @ w.t(), temperature, fresh=True)
            local, owned = _local_targets(targets[i:j], vocab_start, n_valid)
            lse, zt, ez = _chunk_forward(z, local, owned, with_entropy, group)
            del z
            logprobs[i:j] = zt - lse
            lse_all[i:j] = lse
            if with_entropy:
                ez_all[i:j] = ez
        entropy = lse_all - ez_all if with_entropy else logprobs.new_empty(0)
        ctx.save_for_backward(hidden, weight, targets, lse_all, ez_all)
        ctx.args = (temperature, vocab_start, n_valid, chunk, with_entropy)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_h: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, lse_all, ez_all = ctx.saved_tensors
        temperature, vocab_start, n_valid, chunk, with_entropy = ctx.args
        g_h = g_h if with_entropy else None
        w = weight[:n_valid]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        # The weight gradient sums over all chunks: accumulate in fp32 when the weight is
        # lower precision, so bf16 rounding does not compound chunk after chunk.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for i in range(0, hidden.shape[0], chunk):
            j = min(i + chunk, hidden.shape[0])
            glp, gh = _grad_slices((g_lp, g_h), i, j, temperature)
            if (glp is None and gh is None) or n_valid == 0:
                continue
            h = hidden[i:j]
            z = _scaled_fp32(h @ w.t(), temperature, fresh=True)  # recomputed: the logits were never kept
            local, owned = _local_targets(targets[i:j], vocab_start, n_valid)
            ez = ez_all[i:j] if with_entropy else None
            g = _chunk_grad_z(z, lse_all[i:j], ez, local, owned, glp, gh).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[i:j] = g @ w
            if grad_w is not None:
                if g.dtype == torch.float32:
                    grad_w[:n_valid].addmm_(g.t(), h)
                else:
                    grad_w[:n_valid] += (g.t() @ h).float()
            del g, z
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return grad_hidden, grad_w, None, None, None, None, None, None, None


def logprobs_from_hidden(hidden: Tensor, weight_shard: Tensor, targets: Tensor, *, temperature: float = 1.0,
                         vocab_start: int, true_vocab_size: int, tp_group: ProcessGroup | None = None,
                         chunk_tokens: int = 1024, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Like :func:`vocab_parallel_logprobs`, but from the final hidden states ``[T, H]`` and the
    output-layer weight shard ``[V/tp, H]`` (no bias, as in megatron's GPT output layer): the
    logits are formed, used and dropped one ``[chunk, V/tp]`` block at a time, in forward and
    again in backward, so no ``[T, V/tp]`` tensor ever exists.

    The matmul runs in the inputs' dtype (bf16 on GPUs, like megatron's output layer); the
    softmax in fp32. Gradients flow to ``hidden`` and ``weight_shard``; the weight gradient
    is accumulated over chunks in fp32 and cast back to the weight's dtype at the end.

    Under TP the hidden-state gradient returned here is this rank's *partial* sum (only its
    vocab shard's logits depend on it through this rank's weights); the full gradient is the
    sum over the TP group. Megatron's ``ColumnParallelLinear`` does that all-reduce itself;
    here the caller gets it by passing the hidden states through the same region op first:
    ``hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)`` (identity
    forward, all-reduce backward) without sequence parallelism, or
    ``tensor_parallel.gather_from_sequence_parallel_region(hidden)`` with it (all-gather
    forward, reduce-scatter backward). The weight gradient needs no reduction: the shard
    is this rank's own parameter.
    """
    for name, t in (("hidden", hidden), ("weight_shard", weight_shard)):
        if not isinstance(t, Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point 2-D tensor, got "
                             + (f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__))
    if hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"hidden [T, H] = {tuple(hidden.shape)} and weight_shard [V/tp, H] = "
                         f"{tuple(weight_shard.shape)} disagree on H")
    if hidden.dtype != weight_shard.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight_shard ({weight_shard.dtype}) must share a dtype")
    n, shard = hidden.shape[0], weight_shard.shape[0]
    _check_common(n, targets, temperature, vocab_start, shard, true_vocab_size, tp_group, chunk_tokens)
    _check_same_device(hidden=hidden, weight_shard=weight_shard, targets=targets)
    n_valid = max(0, min(shard, true_vocab_size - vocab_start))
    lp, ent = _LogprobsFromHidden.apply(hidden, weight_shard, targets, float(temperature), vocab_start, n_valid,
                                        tp_group, chunk_tokens, with_entropy)
    return lp, (ent if with_entropy else None)


# --------------------------------------------------------------------------- reference and packing


def reference_logprobs(logits_shard: Tensor, targets: Tensor, *, temperature: float = 1.0, true_vocab_size: int,
                       tp_group: ProcessGroup | None = None,
                       with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """The straightforward way, for tests and benchmarks: all-gather the full ``[T, V]`` logits
    over the TP group, drop the padding, and apply the sampling module's
    :func:`~realscale.algo.sampling.token_logprobs`; entropy ``-sum p log p``.
    Differentiable only without TP (the gather is not)."""
    full = logits_shard
    _, world = _group_rank_world(tp_group)
    if world > 1:
        backend = group_backend(tp_group)
        parts = [comm_empty(logits_shard.shape, logits_shard.dtype, backend) for _ in range(world)]
        dist.all_gather(parts, to_comm(logits_shard, backend), group=tp_group)
        full = torch.cat(parts, dim=1)
    full = full[:, :true_vocab_size]
    lp = token_logprobs(full, targets, temperature)
    if not with_entropy:
        return lp, None
    logp = torch.log_softmax(full.float() / temperature, dim=-1)
    return lp, -(logp.exp() * logp).sum(dim=-1)


def next_token_targets(tokens: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """Targets for packed sequences: row t's logits predict ``tokens[t + 1]`` of the same sequence.

    Returns ``(targets, valid)``, both ``[T]``. The last position of every sequence has no
    next token: its target is set to that position's own token (any in-range id does, it
    keeps the id check meaningful) and ``valid`` is False there, so the caller masks it.
    """

    check_1d("tokens", tokens)
    check_cu_seqlens(cu_seqlens, tokens.numel())
    targets = torch.roll(tokens, -1) if tokens.numel() else tokens.clone()
    valid = torch.ones(tokens.numel(), dtype=torch.bool, device=tokens.device)
    ends = cu_seqlens[1:].long() - 1
    ends = ends[cu_seqlens[1:] > cu_seqlens[:-1]]  # empty sequences have no last position
    valid[ends] = False
    targets[ends] = tokens[ends]
    return targets, valid

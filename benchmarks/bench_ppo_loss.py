"""Claim: our decoupled PPO loss, forward + backward on 1M packed tokens, gives the same
values and gradients as AReaL's ``ppo_actor_loss_fn`` and takes <= 23 ms on 2 CPU cores
(the time AReaL's took when it was measured on this kind of machine).

The reference below is written here, from reading areal 1.0.4
(``areal/utils/functional/functional.py``: ``ppo_actor_loss_fn`` with token-level
rejection sampling, action "mask", metric "ratio", i.e. the old
``behave_imp_weight_cap`` in mask mode), step for step the way it computes: the
importance weight and its mask first (with the ``.item()`` counts it logs), the ratio
masked with ``torch.where``, the clipped surrogate with its clip masks, dual clip,
multiplication by the weight, a masked sum over the original token count, and the same
per-token statistics it returns. Both run through ordinary autograd in one process on the
same tensors; the table gives the median of ``--reps`` fwd+bwd runs and the ratio.

    python benchmarks/bench_ppo_loss.py [--tokens 1000000] [--reps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Callable

import torch

from realscale.algo.losses import ppo_loss

from _stats import load_average, spread  # noqa: E402 - benchmarks/ is not a package

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ppo_loss.json")


def areal_style_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     advantages: torch.Tensor, eps_clip: float, loss_mask: torch.Tensor,
                     eps_clip_higher: float | None, c_clip: float | None, cap: float) -> tuple[torch.Tensor, dict]:
    """The reference: AReaL's token-level decoupled PPO loss with a mask-mode weight cap."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    # Rejection sampling, token level, metric = ratio, action = mask.
    log_ratio = proximal_logprobs.detach().float() - old_logprobs.detach().float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    metric = torch.exp(log_ratio)
    behave_imp_weight = torch.exp(log_ratio)
    in_bounds = metric <= cap
    candidates = loss_mask.bool()
    loss_mask = (candidates & in_bounds).to(loss_mask.dtype)
    filtered_fraction = (candidates & ~in_bounds).sum().item() / max(candidates.sum().item(), 1)
    behave_imp_weight = torch.where(loss_mask.bool(), behave_imp_weight, 0.0)
    # Token-level ratio and the clipped surrogate.
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    hi = 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, hi)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    clip_mask = pg_loss1.detach() < pg_loss2.detach()
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if c_clip is not None:
        pg_loss3 = torch.sign(advantages) * c_clip * advantages
        dual_clip_mask = pg_loss3.detach() < pg_loss.detach()
        pg_loss = torch.min(pg_loss, pg_loss3)
    else:
        dual_clip_mask = torch.zeros_like(clip_mask)
    behave_approx_kl = proximal_logprobs.detach() - old_logprobs.detach()
    behave_mask = (behave_imp_weight > 0).logical_and(loss_mask.bool())
    behave_approx_kl = torch.where(behave_mask, behave_approx_kl, 0.0)
    pg_loss = pg_loss * behave_imp_weight
    logging_loss = pg_loss.detach()
    pg_loss = torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count
    clip_mask.logical_and_(loss_mask)
    dual_clip_mask.logical_and_(loss_mask)
    stat = dict(loss=logging_loss, importance_weight=ratio.detach(), approx_kl=(logprobs - proximal_logprobs).detach(),
                clip_mask=clip_mask, dual_clip_mask=dual_clip_mask, behave_approx_kl=behave_approx_kl,
                behave_imp_weight=behave_imp_weight.detach(), behave_mask=behave_mask,
                filtered_fraction=filtered_fraction)
    return pg_loss, stat


def make_inputs(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Log-probs of a policy a few versions ahead of its behaviour policy; 85% loss tokens."""
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(n, generator=g) * 3.0
    prox = behav + torch.randn(n, generator=g) * 0.3  # staleness: some w above the cap of 5? few
    prox[torch.rand(n, generator=g) < 0.01] += 2.0  # 1% badly stale tokens, w > cap
    logp = prox + torch.randn(n, generator=g) * 0.1
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) < 0.85
    return {"logp": logp, "prox": prox, "behav": behav, "adv": adv, "mask": mask}


EPS, EPS_HIGH, DUAL, CAP = 0.2, 0.28, 3.0, 5.0


def run_ours(x: dict[str, torch.Tensor], logp: torch.Tensor) -> torch.Tensor:
    loss, _ = ppo_loss(logp, x["behav"], x["adv"], x["mask"], logp_prox=x["prox"], eps_clip=EPS,
                       eps_clip_high=EPS_HIGH, dual_clip=DUAL, imp_weight_cap=CAP, imp_weight_mode="mask")
    return loss


def run_ref(x: dict[str, torch.Tensor], logp: torch.Tensor) -> torch.Tensor:
    loss, _ = areal_style_loss(logp, x["prox"], x["behav"], x["adv"], EPS, x["mask"], EPS_HIGH, DUAL, CAP)
    return loss


def fwd_bwd(run: Callable[[dict, torch.Tensor], torch.Tensor], x: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    logp = x["logp"].clone().requires_grad_()
    t0 = time.perf_counter()
    loss = run(x, logp)
    loss.backward()
    return time.perf_counter() - t0, torch.cat([loss.detach().view(1), logp.grad])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = make_inputs(args.tokens)
    _, ours_out = fwd_bwd(run_ours, x)
    _, ref_out = fwd_bwd(run_ref, x)
    loss_diff = abs(float(ours_out[0] - ref_out[0]))
    grad_diff = float((ours_out[1:] - ref_out[1:]).abs().max())
    grad_scale = float(ref_out[1:].abs().max())
    torch.testing.assert_close(ours_out, ref_out, rtol=1e-5, atol=1e-9)
    times: dict[str, list[float]] = {"ours": [], "ref": []}
    load_before = load_average()
    for _ in range(args.reps):  # interleaved, so machine noise hits both alike
        times["ours"].append(fwd_bwd(run_ours, x)[0])
        times["ref"].append(fwd_bwd(run_ref, x)[0])
    load_after = load_average()
    stats = {k: spread(v) for k, v in times.items()}
    ratio = stats["ref"].median / stats["ours"].median
    print(f"{args.tokens:,} tokens, {args.threads} threads, torch {torch.__version__}, float32; "
          f"eps {EPS}/{EPS_HIGH}, dual clip {DUAL}, cap {CAP} (mask); load average {load_before:.2f} -> {load_after:.2f}")
    print(f"loss: ours {float(ours_out[0]):.9f}  reference {float(ref_out[0]):.9f}  |diff| {loss_diff:.2e}; "
          f"max |grad diff| {grad_diff:.2e} (max |grad| {grad_scale:.2e})\n")
    print(f"| implementation | median ms (IQR), {args.reps} reps | best ms | vs reference (median) |")
    print("|---|---:|---:|---:|")
    print(f"| ours: realscale.algo.losses.ppo_loss | {stats['ours'].cell(1e3)} | {stats['ours'].lo * 1e3:.2f} | "
          f"{ratio:.2f}x |")
    print(f"| reference: AReaL-style ppo_actor_loss_fn | {stats['ref'].cell(1e3)} | {stats['ref'].lo * 1e3:.2f} | 1.00x |")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump({"benchmark": "ppo_loss", "machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                   "load_average": [load_before, load_after],
                   "tokens": args.tokens, "reps": args.reps, "seconds": {k: v.as_dict() for k, v in stats.items()},
                   "speedup_median": ratio, "loss_abs_diff": loss_diff,
                   "grad_max_abs_diff": grad_diff}, fh, indent=1)
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()

"""Worker functions for the reference-policy tests (spawned trainer ranks import this module)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

import trainer_cases


def perturbed_copy(model_dir: str, out_dir: str, scale: float = 0.05, seed: int = 7) -> str:
    """A copy of ``model_dir`` with noise on every weight: a reference that differs from
    the policy from the first step on (``model.ref_path``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


def _cfg(tp: int, dp: int, kl_coef: float, *extra: str) -> Any:
    from realscale.config import load_config

    return load_config(None, [f"parallel.tp={tp}", f"parallel.dp={dp}", "optim.lr=1e-3", "train.mini_batches=1",
                              "train.max_tokens_per_micro_batch=40", f"algo.kl_coef={kl_coef}", *extra])


def _batch(engine: Any, cfg: Any, seed: int) -> Any:
    """Synthetic groups (tokens and rewards fixed by ``seed``; behaviour log-probs from
    ``engine``, as an up-to-date server would give) packed on rank 0, on every rank."""
    import torch.distributed as dist

    from realscale.train.actor import broadcast_batch, groups_to_batch

    groups = trainer_cases.synthetic_groups(engine, seed=seed)  # every rank: same collectives
    batch = groups_to_batch(groups, cfg.algo)[0] if dist.get_rank() == 0 else None
    return broadcast_batch(batch)


def exact_kl(policy: Any, ref: Any, batch: Any) -> float | None:
    """KL(policy || ref) summed over the whole vocabulary, averaged over every position
    that predicts a token of its sequence (last pipeline stage; None elsewhere)."""
    lp, lq = policy.full_logits(batch), ref.full_logits(batch)
    if lp is None:
        return None
    lp, lq = lp.log_softmax(-1), lq.log_softmax(-1)
    per_row = (lp.exp() * (lp - lq)).sum(-1)
    keep = torch.ones(batch.num_tokens, dtype=torch.bool)
    keep[batch.cu_seqlens[1:] - 1] = False  # a sequence's last row predicts past its end
    return float(per_row[keep].mean())


def kl_after_steps(model_dir: str, steps: int, kl_coefs: list[float]) -> dict[str, Any]:
    """For each ``kl_coef``: a fresh policy from ``model_dir`` trained ``steps`` PPO steps
    against the reference (the same starting weights), on the same token sequences and
    rewards; then the exact KL of policy and reference on a held-out batch. Also checks
    that the reference stayed frozen and that offload / restore gives it back whole."""
    from realscale.train.actor import update_policy
    from realscale.train.engine import EngineConfig, MegatronEngine
    from realscale.train.reference import ReferenceEngine, reference_for

    out: dict[str, Any] = {"kl": {}, "stats": {}}
    ref = None
    for i, coef in enumerate(kl_coefs):
        cfg = _cfg(1, 1, coef)
        engine = MegatronEngine(EngineConfig.from_config(cfg, model_dir), shared_layout=i > 0)
        if ref is None:  # kl_coef 0 loads no reference in a run; here both arms measure against one
            ref = reference_for(_cfg(1, 1, max(kl_coefs)), model_dir)
            assert isinstance(ref, ReferenceEngine)
            frozen = [p.detach().clone() for p in ref.model.parameters()]
        out["stats"][coef] = [update_policy(engine, trainer_cases.scattered(engine, cfg, _batch(engine, cfg, seed=s)),
                                            cfg, None, ref) for s in range(steps)]
        out["kl"][coef] = exact_kl(engine, ref, _batch(engine, cfg, seed=1000))
    out["frozen"] = all(torch.equal(a, b) for a, b in zip(frozen, ref.model.parameters()))
    out.update(offload_checks(ref, _batch(ref, cfg, seed=2000)))
    return out


def offload_checks(ref: Any, batch: Any) -> dict[str, Any]:
    """Parameter bytes (and CUDA memory) before and after ``offload``; log-probs refused
    while offloaded and bit-identical after ``restore``."""
    cuda = ref.device.type == "cuda"
    before = ref.ref_logprobs(batch)
    out: dict[str, Any] = {"bytes_resident": ref.param_bytes()}
    allocated = torch.cuda.memory_allocated() if cuda else 0
    ref.offload()
    out["bytes_offloaded"] = ref.param_bytes()
    out["cuda_freed"] = allocated - torch.cuda.memory_allocated() if cuda else 0
    try:
        ref.ref_logprobs(batch)
        out["offloaded_refuses"] = False
    except RuntimeError as exc:
        out["offloaded_refuses"] = "offloaded" in str(exc)
    ref.restore()
    out["restored_equal"] = torch.equal(before, ref.ref_logprobs(batch))
    return out


def offload_roundtrip(model_dir: str) -> dict[str, Any]:
    """:func:`offload_checks` on a reference built alone on this rank's device."""
    from realscale.train.engine import EngineConfig
    from realscale.train.reference import ReferenceEngine

    ref = ReferenceEngine(EngineConfig(model_path=model_dir, lr=None), shared_layout=False)
    return offload_checks(ref, _batch(ref, _cfg(1, 1, 0.1), seed=0))


def one_step_against(model_dir: str, ref_dir: str, tp: int, dp: int) -> dict[str, Any]:
    """One PPO step with the KL term against the reference in ``ref_dir``
    (``model.ref_path``): the reference log-probs of the whole batch, the step's
    statistics and the policy's log-probs after it."""
    from realscale.train.actor import update_policy
    from realscale.train.engine import EngineConfig, MegatronEngine
    from realscale.train.reference import reference_for

    cfg = _cfg(tp, dp, 0.5, f"model.ref_path={ref_dir}")
    engine = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
    ref = reference_for(cfg, model_dir)
    batch = _batch(engine, cfg, seed=0)
    ref_lp = ref.ref_logprobs(batch)
    stats = update_policy(engine, trainer_cases.scattered(engine, cfg, batch), cfg, None, ref)
    return {"ref_logprobs": ref_lp, "stats": stats, "after": engine.logprobs(batch)["logprobs"],
            "loss_mask": batch.fields["loss_mask"]}

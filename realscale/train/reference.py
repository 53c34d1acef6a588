"""The frozen reference policy of the KL penalty (``algo.kl_coef > 0``; plan role ``ref_inf``).

What it is: the policy's architecture, frozen at the weights of ``model.ref_path``, or by
default at the policy's *starting* weights (the model directory the run began from: the
warm start, not the latest checkpoint, so a resumed run keeps the same reference). It has
no optimizer, no DDP wrapper and no gradients; it only computes log-probs.

Per RL step (:func:`realscale.train.actor.update_policy`), before any update, on each
data-parallel share of each mini-batch:

1. **reference log-probs** — ``ref_logprobs`` for every token, aligned like the policy's
   (:mod:`realscale.train.batch`), at the trainer's temperature;
2. **loss** — :func:`realscale.algo.losses.ppo_loss` adds ``kl_coef * KL(policy || ref)``
   per trained token with ``algo.kl_estimator`` (:func:`realscale.algo.kl.kl_penalty`),
   masked and aggregated exactly like the PPO surrogate (``algo.loss_agg``, global
   normaliser), not weighted by the behaviour importance weight;
3. **metrics** — ``actor/kl_ref``: the measured mean KL (same estimator) between the
   policy at the start of the step (the proximal log-probs) and the reference, over every
   trained token of the global batch (all mini-batches, all data-parallel ranks);
   ``actor/kl_loss``: the KL term the last optimizer step added to the loss
   (``kl_coef * train/kl``).

Placement (how this departs from ReaL, whose planner may give the reference its own mesh
and layout): the reference runs on the actor's trainer ranks *in the actor's layout*
(tp/pp/dp), built beside the policy with ``shared_layout`` like the critic. A plan's
``ref_inf`` role is accepted when it sits on ``actor_train``'s devices (its strategy may
differ: the runtime computes reference log-probs in the training layout) and refused
elsewhere (:mod:`realscale.planner.validate`); a reference on a mesh of its own is not
implemented. Sequences never span data-parallel shares, so one rank equals N ranks.

Memory between uses (colocated mode): :meth:`ReferenceEngine.offload` releases the
parameters and :meth:`ReferenceEngine.restore` brings them back bit-identical:

- on a GPU the parameters move to pinned host memory and the device copies are freed
  (**not run here**: this repository's CI has no GPU);
- on CPU, host memory *is* the device memory, so moving would release nothing: the
  parameter storage is freed and :meth:`restore` reads the reference's safetensors again
  (the only way to release it there; the file stays in the page cache).
"""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from realscale.algo.kl import masked_kl_sum
from realscale.config import ConfigError
from realscale.models.convert import load_hf_weights
from realscale.models.family import load_arch
from realscale.models.tiny import BUILTIN, resolve_model_path
from realscale.parallel.device import to_comm
from realscale.train.batch import PackedBatch
from realscale.train.engine import EngineConfig, MegatronEngine

if TYPE_CHECKING:
    from realscale.config import AlgoConfig, Config
    from realscale.parallel.megatron_state import RankInfo

# The fields that give a model's tensors their shapes: a reference must match the policy in all.
SHAPE_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "ffn_hidden_size", "tie_embeddings")


def reference_model_dir(cfg: "Config", model_dir: str) -> str:
    """The reference's HF directory: ``model.ref_path`` (a directory or built-in tiny name)
    or the policy's starting ``model_dir``; a one-line ConfigError when it is missing or
    not the policy's architecture."""

    path = cfg.model.ref_path
    if not path:
        return model_dir
    if path not in BUILTIN and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.ref_path: {path} is not an HF model directory (no config.json there)")
    path = resolve_model_path(path)
    ref, policy = load_arch(path), load_arch(model_dir)
    for name in SHAPE_FIELDS:
        mine, theirs = (getattr(a, name) for a in (ref, policy))
        if mine != theirs:
            mine, theirs = (getattr(v, "name", v) for v in (mine, theirs))  # a Family by its name
            raise ConfigError(f"model.ref_path: {path} has {name}={mine!r}, the policy {theirs!r}; the reference "
                              "must have the policy's architecture")
    return path


class ReferenceEngine(MegatronEngine):
    """A frozen copy of the policy's architecture on the actor's ranks and layout: log-probs only."""

    def __init__(self, ec: EngineConfig, *, shared_layout: bool = True) -> None:
        super().__init__(dataclasses.replace(ec, lr=None), shared_layout=shared_layout)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._shapes: dict[str, torch.Size] = {}
        self._host: dict[str, torch.Tensor] = {}
        self.resident = True

    def ref_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """Per-token reference log-probs of ``batch`` (fp32, CPU), on every rank of this replica."""
        if not self.resident:
            raise RuntimeError("the reference policy is offloaded; call restore() before computing log-probs")
        return self.logprobs(batch)["logprobs"]

    def param_bytes(self) -> int:
        """Bytes of parameter storage this rank holds on its device now."""
        return sum(p.untyped_storage().nbytes() for p in self.model.parameters())

    def offload(self) -> None:
        """Release the parameters' device memory (see the module docstring); idempotent."""
        if not self.resident:
            return
        for name, p in self.model.named_parameters():
            self._shapes[name] = p.shape
            if p.device.type != "cpu":
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                host.copy_(p.data, non_blocking=True)
                self._host[name] = host
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        gc.collect()
        self.resident = False

    def restore(self) -> None:
        """Bring the parameters back after :meth:`offload`; idempotent."""
        if self.resident:
            return
        for name, p in self.model.named_parameters():
            p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=p.device)
            if name in self._host:
                p.data.copy_(self._host[name], non_blocking=True)
        if self._host:
            torch.cuda.synchronize()
        else:  # CPU: nothing was kept, read the weights again

            with torch.no_grad():
                load_hf_weights(self.model, self.ec.model_path, self.arch, self.ranks.tp_rank, self.ec.tp)
        self._host.clear()
        self.resident = True


def reference_for(cfg: "Config", model_dir: str) -> ReferenceEngine | None:
    """The run's reference policy on the actor's ranks (built after the actor), or None
    when ``algo.kl_coef`` is 0."""
    if not cfg.algo.kl_coef:
        return None
    ec = EngineConfig.from_config(cfg, reference_model_dir(cfg, model_dir), train=False)
    return ReferenceEngine(ec)


def add_ref_logprobs(ref: ReferenceEngine, shares: list[PackedBatch]) -> None:
    """``ref_logprobs`` on every share (before any update; the loss reads them)."""
    for share in shares:
        share.fields["ref_logprobs"] = ref.ref_logprobs(share)


def measured_kl(shares: list[PackedBatch], policy_key: str, algo: "AlgoConfig", ranks: "RankInfo") -> float:
    """Mean KL(policy || reference) per trained token over the global batch: the shares of
    this rank, summed over data-parallel ranks (``policy_key``: the policy's log-probs
    field, taken before any update)."""

    total = torch.zeros(2, dtype=torch.float64)
    for s in shares:
        f = s.fields
        total += masked_kl_sum(f[policy_key], f["ref_logprobs"], f["loss_mask"], algo.kl_estimator).cpu()
    if ranks.dp > 1:
        total = to_comm(total, dist.get_backend())
        dist.all_reduce(total, group=ranks.dp_group)
        total = total.cpu()
    return float(total[0] / total[1].clamp(min=1.0))

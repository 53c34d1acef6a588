"""Fixes to megatron-core that we carry on every device (not CPU-specific).

``apply()`` is idempotent and version-checked like :mod:`megatron_patches.cpu`.
"""

from __future__ import annotations

from typing import Any

_applied: list[str] = []


def _fix_torch_adam_step_on_reshardable_load() -> None:
    """optimizer/distrib_optimizer.py ``DistributedOptimizer._set_main_param_and_optimizer_states``
    copies every key of a parameter's optimizer state from the loaded tensors. With
    torch's own Adam (no Apex or TE installed) that state holds ``step``, which the
    ``fully_reshardable`` checkpoint format does not store per parameter (it travels in
    ``param_groups`` and ``load_state_dict`` has already restored it), so loading raises
    ``KeyError: 'step'``. We hand the already-restored step back in."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_realscale_fixed", False):
        return

    def fixed(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = getattr(self.optimizer, "state", {}).get(main_param, {})
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        original(self, model_param, tensors)

    fixed._realscale_fixed = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = fixed  # type: ignore[method-assign]


def _fix_shared_adam_step_tensor() -> None:
    """optimizer/distrib_optimizer.py ``DistributedOptimizer.load_state_dict`` (torch Adam
    branch, no Apex/TE) puts *one* ``step`` tensor into every parameter's state. torch's
    Adam increments each parameter's step in place, so after loading, the shared counter
    advances once per parameter per optimizer step and Adam's bias correction goes wrong
    (updates shrink). We give every parameter its own copy after loading."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict
    if getattr(original, "_realscale_fixed", False):
        return

    def load_state_dict(self: Any, state_dict: Any) -> Any:
        result = original(self, state_dict)
        for state in getattr(self.optimizer, "state", {}).values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is not None and hasattr(step, "clone"):
                state["step"] = step.clone()
        return result

    load_state_dict._realscale_fixed = True  # type: ignore[attr-defined]
    DistributedOptimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]


def _fix_router_gemm_without_te() -> None:
    """transformer/moe/moe_utils.py imports ``te_general_gemm`` (with the other fused MoE
    kernels) from Transformer Engine inside a ``try`` whose ``except ImportError`` binds
    nothing, yet ``RouterGatingLinearFunction.forward``/``backward`` (lines 1192 and 1225 in
    0.16.1) test ``te_general_gemm is not None``: without TE every MoE router forward
    raises ``NameError``. We bind the missing name to None, the value the code expects
    when TE is absent (it then takes its ``torch.mm`` branch). The fused permute/top-k
    kernels are only reached behind config flags we leave off (moe_permute_fusion,
    moe_router_fusion)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


FIXES = (_fix_torch_adam_step_on_reshardable_load, _fix_shared_adam_step_tensor, _fix_router_gemm_without_te)


def apply() -> list[str]:
    """Apply every fix once; returns their names."""
    if _applied:
        return list(_applied)
    from megatron_patches.cpu import check_version

    check_version()
    for fix in FIXES:
        fix()
        _applied.append(fix.__name__.lstrip("_"))
    return list(_applied)

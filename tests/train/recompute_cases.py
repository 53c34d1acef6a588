"""Worker for test_recompute (spawned ranks import this module)."""

from __future__ import annotations

from typing import Any

import engine_cases as cases


def train_with(model_dir: str, recompute: str, tp: int = 1, pp: int = 1, steps: int = 2) -> dict[str, Any]:
    """``steps`` PPO steps with ``train.recompute=recompute``; losses, grad norms, final
    log-probs, and how many times Megatron's checkpoint function ran."""
    import megatron.core.tensor_parallel as tensor_parallel
    from megatron.core.transformer import attention, transformer_block

    from realscale.train.engine import EngineConfig, MegatronEngine

    calls = {"n": 0}
    original = tensor_parallel.checkpoint

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return original(*args, **kwargs)

    transformer_block.tensor_parallel.checkpoint = counted  # the module attribute both call through
    attention.tensor_parallel.checkpoint = counted
    eng = MegatronEngine(EngineConfig(model_path=model_dir, tp=tp, pp=pp, lr=1e-3, max_tokens_per_micro_batch=24,
                                      clip_grad=1.0, temperature=0.8, logprob_chunk_tokens=5, total_steps=10,
                                      recompute=recompute))
    batch, _ = cases.with_behaviour(eng, cases.rl_batch(eng.arch.vocab_size))
    stats = [eng.train_step(cases.dp_share(batch), cases.ppo_loss_fn) for _ in range(steps)]
    return {"loss": [s["loss"] for s in stats], "grad_norm": [s["grad_norm"] for s in stats],
            "lp1": eng.logprobs(batch)["logprobs"], "checkpoints": calls["n"],
            "granularity": eng.config.recompute_granularity}


def run_all(model_dir: str, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    return {rc: train_with(model_dir, rc, tp, pp) for rc in ("none", "selective", "full")}

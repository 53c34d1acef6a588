"""Worker functions for the mixture-of-experts engine tests (spawned ranks import this module)."""

from __future__ import annotations

from typing import Any

import torch

import engine_cases as cases


def engine(model_dir: str, tp: int, pp: int, ep: int, budget: int = 24, lr: float | None = 1e-3,
           aux: float | None = 0.0, replay: bool = False) -> Any:
    from realscale.train.engine import EngineConfig, MegatronEngine

    # megatron's MoE layer trains with tp > 1 only under sequence parallelism
    return MegatronEngine(EngineConfig(model_path=model_dir, tp=tp, pp=pp, ep=ep, lr=lr, moe_aux_loss_coef=aux,
                                       sequence_parallel=tp > 1, routing_replay=replay,
                                       max_tokens_per_micro_batch=budget, clip_grad=1.0, temperature=0.8,
                                       logprob_chunk_tokens=5, total_steps=10))


def logits_vs_hf(model_dir: str, tp: int, pp: int, ep: int) -> dict[str, Any]:
    """Max |megatron - HF| of the full logits over packed sequences (several micro-batches)."""
    from realscale.train.batch import PackedBatch

    eng = engine(model_dir, tp, pp, ep, lr=None)
    seqs = cases.sequences(eng.arch.vocab_size)
    logits = eng.full_logits(PackedBatch.from_sequences(seqs))
    if logits is None:
        return {"diff": None}
    ref = torch.cat(cases.hf_logits(model_dir, seqs))
    return {"diff": float((logits - ref).abs().max()), "scale": float(ref.abs().max())}


def train_steps(model_dir: str, tp: int, pp: int, ep: int, steps: int, n_seqs: int = 6, budget: int = 24,
                aux: float | None = 0.0, export_dir: str | None = None) -> dict[str, Any]:
    """Log-probs, ``steps`` PPO steps on this data-parallel rank's share, log-probs again;
    optionally the HF export of the trained weights (rank 0 writes)."""
    eng = engine(model_dir, tp, pp, ep, budget=budget, aux=aux)
    batch, lp0 = cases.with_behaviour(eng, cases.rl_batch(eng.arch.vocab_size, n=n_seqs))
    share = cases.dp_share(batch)
    mbs, plan = eng._micro_batches(share)
    stats = [eng.train_step(share, cases.ppo_loss_fn) for _ in range(steps)]
    lp1 = eng.logprobs(batch)["logprobs"]
    if export_dir is not None:
        eng.save_hf(export_dir)
    return {"lp0": lp0, "lp1": lp1, "stats": stats, "micro_batches": (len(plan), len(mbs))}


def export_untrained(model_dir: str, tp: int, pp: int, ep: int, out_dir: str) -> dict[str, Any]:
    """HF -> megatron (tp, pp, ep) -> HF; rank 0 writes ``out_dir``."""
    engine(model_dir, tp, pp, ep, lr=None).save_hf(out_dir)
    return {"ok": True}


def router_after_step(model_dir: str, aux: float) -> dict[str, Any]:
    """Layer 0's router weights after one step with auxiliary-loss coefficient ``aux``."""
    eng = engine(model_dir, 1, 1, 1, aux=aux)
    batch, _ = cases.with_behaviour(eng, cases.rl_batch(eng.arch.vocab_size))
    eng.train_step(batch, cases.ppo_loss_fn)
    return {"router": eng.model.decoder.layers[0].mlp.router.weight.detach().clone(),
            "aux_type": eng.config.moe_router_load_balancing_type, "aux_coef": eng.config.moe_aux_loss_coeff}


def checkpoint(model_dir: str, tp: int, pp: int, ep: int, ckpt: str, mode: str, steps: int = 2) -> dict[str, Any]:
    """mode 'save': 2 PPO steps, save, ``steps`` more; 'load': load (into this layout), ``steps``."""
    eng = engine(model_dir, tp, pp, ep)
    batch = cases.rl_batch(eng.arch.vocab_size)
    if mode == "save":
        batch, _ = cases.with_behaviour(eng, batch)
        torch.save(batch.fields["behav_logprobs"], ckpt + ".behav.pt")
        for _ in range(2):
            eng.train_step(cases.dp_share(batch), cases.ppo_loss_fn)
        eng.save(ckpt, extra={"data_position": 5})
    else:
        eng.load(ckpt)
        batch.fields["behav_logprobs"] = torch.load(ckpt + ".behav.pt")
    stats = [eng.train_step(cases.dp_share(batch), cases.ppo_loss_fn) for _ in range(steps)]
    return {"losses": [s["loss"] for s in stats], "grad_norms": [s["grad_norm"] for s in stats]}


def hf_routing(model_dir: str, batch: Any, least: bool) -> torch.Tensor:
    """``[tokens, layers * top_k]`` int32 per packed token: the experts transformers'
    Qwen3-MoE routes each position to (``least``: the top-k *least* likely instead, a
    routing the trainer would never choose itself)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    k = model.config.num_experts_per_tok
    rows = []
    with torch.no_grad():
        for i in range(batch.num_seqs):
            ids = batch.sequence(i)
            logits = model(ids[None], output_router_logits=True).router_logits
            pick = [(-lg if least else lg).view(len(ids), -1).topk(k, dim=-1).indices for lg in logits]
            rows.append(torch.cat(pick, dim=1))
    return torch.cat(rows).to(torch.int32)


def replay(model_dir: str, tp: int, pp: int, ep: int) -> dict[str, Any]:
    """Log-probs of one batch: routed by the trainer, replaying transformers' own routing,
    replaying the least likely experts; then one PPO step under that forced routing."""
    eng = engine(model_dir, tp, pp, ep, replay=True)
    batch = cases.rl_batch(eng.arch.vocab_size)
    plain = eng.logprobs(batch)["logprobs"]  # no routed_experts field: the trainer routes
    batch.fields["routed_experts"] = hf_routing(model_dir, batch, least=False)
    own = eng.logprobs(batch)["logprobs"]
    batch.fields["routed_experts"] = hf_routing(model_dir, batch, least=True)
    forced = eng.logprobs(batch)["logprobs"]
    batch.fields["behav_logprobs"] = forced + 0.05
    stats = eng.train_step(cases.dp_share(batch), cases.ppo_loss_fn)
    return {"plain": plain, "own": own, "forced": forced, "after": eng.logprobs(batch)["logprobs"],
            "after_plain": eng.logprobs(_without(batch))["logprobs"], "stats": stats}


def _without(batch: Any) -> Any:
    from realscale.train.batch import PackedBatch

    return PackedBatch(batch.input_ids, batch.cu_seqlens, {k: v for k, v in batch.fields.items()
                                                            if k != "routed_experts"})


def run_many(jobs: list[tuple[str, tuple]]) -> list[Any]:
    """Several cases in one set of processes (spawning ranks costs seconds each)."""
    from realscale.parallel.megatron_state import destroy_megatron

    out = []
    for name, args in jobs:
        out.append(globals()[name](*args))
        destroy_megatron()
    return out

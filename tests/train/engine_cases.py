"""Worker functions for the engine tests (spawned ranks import this module)."""

from __future__ import annotations

from typing import Any

import torch

LENGTHS = (11, 7, 16)


def sequences(vocab: int, lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def hf_logits(model_dir: str, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(s[None]).logits[0].float() for s in seqs]


def logits_diff(model_dir: str, tp: int, pp: int, sp: bool = False, budget: int = 24) -> dict[str, Any]:
    """Max |megatron - HF| over packed sequences (budget forces several micro-batches)."""
    from realscale.train.batch import PackedBatch
    from realscale.train.engine import EngineConfig, MegatronEngine

    eng = MegatronEngine(EngineConfig(model_path=model_dir, tp=tp, pp=pp, sequence_parallel=sp, lr=None,
                                      max_tokens_per_micro_batch=budget))
    seqs = sequences(eng.arch.vocab_size)
    batch = PackedBatch.from_sequences(seqs)
    logits = eng.full_logits(batch)
    if logits is None:
        return {"diff": None}
    ref = torch.cat(hf_logits(model_dir, seqs))
    return {"diff": float((logits - ref).abs().max()), "scale": float(ref.abs().max())}


def roundtrip(model_dir: str, tp: int, pp: int, out_dir: str) -> dict[str, Any]:
    """HF -> megatron (tp, pp) -> HF; rank 0 writes ``out_dir``."""
    from realscale.train.engine import EngineConfig, MegatronEngine

    eng = MegatronEngine(EngineConfig(model_path=model_dir, tp=tp, pp=pp, lr=None))
    eng.save_hf(out_dir)
    return {"ok": True}


def engine(model_dir: str, tp: int = 1, pp: int = 1, sp: bool = False, budget: int = 24, lr: float | None = 1e-3,
           dist_opt: bool = True, share: bool = True) -> Any:
    from realscale.train.engine import EngineConfig, MegatronEngine

    return MegatronEngine(EngineConfig(model_path=model_dir, tp=tp, pp=pp, sequence_parallel=sp, lr=lr,
                                       max_tokens_per_micro_batch=budget, clip_grad=1.0, temperature=0.8,
                                       logprob_chunk_tokens=5, distributed_optimizer=dist_opt, total_steps=10,
                                       share_prefixes=share))


def grouped_sequences(vocab: int, gen: torch.Generator, prompts: int = 2, samples: int = 4) -> list[torch.Tensor]:
    """GRPO-like sequences: each prompt with several answers; the answers draw from 3 tokens,
    so some also share their start, and the last repeats an earlier one exactly."""
    seqs = []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (int(torch.randint(6, 11, (), generator=gen)),), generator=gen)
        for _ in range(samples):
            answer = torch.randint(0, 3, (int(torch.randint(2, 8, (), generator=gen)),), generator=gen)
            seqs.append(torch.cat([prompt, answer]))
    return seqs + [seqs[1].clone()]


def rl_batch(vocab: int, n: int = 6, seed: int = 1, grouped: bool = False) -> Any:
    """A packed batch with the fields a PPO loss needs (prompt tokens masked out).
    ``grouped``: :func:`grouped_sequences` (prefixes to share) instead of ``n`` random ones."""
    from realscale.train.batch import PackedBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = [5 + int(x) for x in torch.randint(0, 14, (n,), generator=gen)]
    seqs = [torch.randint(0, vocab, (m,), generator=gen) for m in lengths]
    if grouped:
        seqs = grouped_sequences(vocab, gen)
        lengths = [len(x) for x in seqs]
    mask = [torch.cat([torch.zeros(2), torch.ones(m - 2)]) for m in lengths]
    behav = [-3.0 + 0.5 * torch.randn(m, generator=gen) for m in lengths]
    adv = [torch.full((m,), float(torch.randn((), generator=gen))) for m in lengths]
    return PackedBatch.from_sequences(seqs, {"loss_mask": mask, "behav_logprobs": behav, "advantages": adv})


def ppo_loss_fn(logp: torch.Tensor, mb: Any, normalizer: torch.Tensor) -> tuple[torch.Tensor, dict]:
    from realscale.algo.losses import ppo_loss

    f = mb.fields
    return ppo_loss(logp, f["behav_logprobs"], f["advantages"], f["loss_mask"], eps_clip=0.2,
                    normalizer=normalizer)


def dp_share(batch: Any) -> Any:
    """This DP rank's half of the batch (sequences dealt round-robin)."""
    from megatron.core import parallel_state as ps

    r, w = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return batch.select(list(range(r, batch.num_seqs, w)))


def with_behaviour(eng: Any, batch: Any, seed: int = 2) -> Any:
    """Behaviour log-probs near the model's own (as a generation server would give):
    ratios near 1, so the clipped objective has gradient on most tokens."""
    gen = torch.Generator().manual_seed(seed)
    lp = eng.logprobs(batch)["logprobs"]
    batch.fields["behav_logprobs"] = lp + 0.1 * torch.randn(lp.shape, generator=gen)
    return batch, lp


def train_steps(model_dir: str, tp: int, pp: int, sp: bool, steps: int, budget: int = 24,
                dist_opt: bool = True, grouped: bool = False, share: bool = True) -> dict[str, Any]:
    """Log-probs, then ``steps`` PPO steps; stats per step and final log-probs."""
    eng = engine(model_dir, tp, pp, sp, budget, dist_opt=dist_opt, share=share)
    batch, lp0 = with_behaviour(eng, rl_batch(eng.arch.vocab_size, grouped=grouped))
    stats = [eng.train_step(dp_share(batch), ppo_loss_fn) for _ in range(steps)]
    lp1 = eng.logprobs(batch)["logprobs"]
    return {"lp0": lp0, "lp1": lp1, "stats": stats}


def checkpoint_then_continue(model_dir: str, tp: int, pp: int, ckpt: str, mode: str, steps: int = 3) -> dict[str, Any]:
    """mode 'save': 2 steps then save, then ``steps`` more; mode 'load': load, then ``steps``."""
    eng = engine(model_dir, tp, pp)
    batch = rl_batch(eng.arch.vocab_size)
    if mode == "save":
        batch, _ = with_behaviour(eng, batch)
        torch.save(batch.fields["behav_logprobs"], ckpt + ".behav.pt")
        for _ in range(2):
            eng.train_step(dp_share(batch), ppo_loss_fn)
        eng.save(ckpt, extra={"data_position": 17})
        extra = {}
    else:
        extra = eng.load(ckpt)
        batch.fields["behav_logprobs"] = torch.load(ckpt + ".behav.pt")
    stats = [eng.train_step(dp_share(batch), ppo_loss_fn) for _ in range(steps)]
    return {"losses": [s["loss"] for s in stats], "grad_norms": [s["grad_norm"] for s in stats],
            "extra": extra, "step_count": eng.step_count}


def logprob_check(model_dir: str, tp: int, pp: int, grouped: bool = False) -> dict[str, Any]:
    """Engine log-probs (temperature 0.8, chunked) vs HF log_softmax(logits / 0.8)."""
    eng = engine(model_dir, tp, pp, lr=None)
    batch = rl_batch(eng.arch.vocab_size, grouped=grouped)
    out = eng.logprobs(batch, with_entropy=True)
    seqs = [batch.sequence(i) for i in range(batch.num_seqs)]
    ref_lp, ref_ent = [], []
    for s, logits in zip(seqs, hf_logits(model_dir, seqs)):
        logp = torch.log_softmax(logits / 0.8, dim=-1)
        ref_lp.append(torch.cat([torch.zeros(1), logp[:-1].gather(1, s[1:, None])[:, 0]]))
        ref_ent.append(torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)[:-1]]))
    return {"lp": float((out["logprobs"] - torch.cat(ref_lp)).abs().max()),
            "ent": float((out["entropy"] - torch.cat(ref_ent)).abs().max())}


def run_many(jobs: list[tuple[str, tuple]]) -> list[Any]:
    """Several cases in one set of processes (spawning ranks costs seconds each)."""
    return [globals()[name](*args) for name, args in jobs]

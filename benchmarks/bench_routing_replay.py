"""Rollout routing replay (R3) on a tiny mixture of experts: how far the trainer's log-probs
are from the generation server's behaviour log-probs with and without replay, and what
replay costs in time and memory. Side by side in one run, same tokens, same weights.

The generation server (the embedded one: its own decoder and expert kernels, like an
inference engine's) samples answers at temperature 1 and reports each position's routed
experts; it runs in bf16 (what GPU inference engines run) and, as a control, in fp32. The
trainer (Megatron's MoE layer, fp32) computes the log-probs of the same tokens twice:
routing by itself, then replaying the server's routing (``algo.routing_replay``). With no
policy lag, the gap is the engines' disagreement alone: replay removes the part due to
tokens routed to other experts. The model is a randomly initialised Qwen3-MoE (8 experts,
2 per token): its router is near-uniform, so near-ties, and with them routing flips
between engines, are common; a trained router is more decisive.

    python benchmarks/bench_routing_replay.py     # writes benchmarks/results/bench_routing_replay.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from realscale.parallel.spawn import run_distributed  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_routing_replay.json")
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96}


def build_model(root: str) -> str:
    from realscale.models.tiny import build_tiny_model

    return build_tiny_model(os.path.join(root, "moe"), family="qwen3_moe", hidden_size=128, num_layers=4,
                            num_heads=4, num_kv_heads=2, intermediate_size=192, moe=MOE, seed=0)


def sample(model: str, dtype: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Answers of an embedded server in ``dtype`` with their behaviour log-probs and routing."""
    from realscale.inference.client import InferenceClient
    from realscale.serve.server import EmbeddedServer, start_in_thread

    url, stop = start_in_thread(EmbeddedServer(model, dtype=dtype, max_running=32, context_length=256))
    try:
        async def main():
            async with InferenceClient([url], routed_experts=True) as c:
                return await asyncio.gather(*(c.generate(p, {"max_new_tokens": new_tokens, "temperature": 1.0,
                                                             "ignore_eos": True}) for p in prompts))
        results = asyncio.run(main())
    finally:
        stop()
    return [{"prompt": p, "out": r.output_ids, "lp": r.output_logprobs, "routed": r.routed_experts}
            for p, r in zip(prompts, results)]


def _batch(samples: list[dict], width: int):
    from realscale.train.batch import PackedBatch

    seqs, mask, behav, routed, adv = [], [], [], [], []
    for s in samples:
        n_p, n_o = len(s["prompt"]), len(s["out"])
        seqs.append(torch.tensor(s["prompt"] + s["out"]))
        mask.append(torch.tensor([0.0] * n_p + [1.0] * n_o))
        behav.append(torch.tensor([0.0] * n_p + s["lp"], dtype=torch.float32))
        rows = torch.as_tensor(s["routed"], dtype=torch.int32).view(-1, width)
        routed.append(torch.cat([rows, rows[-1:]]))
        adv.append(torch.full((n_p + n_o,), float(len(seqs) % 3 - 1)))
    return PackedBatch.from_sequences(seqs, {"loss_mask": mask, "behav_logprobs": behav, "advantages": adv,
                                             "routed_experts": routed})


def _without_routing(batch):
    from realscale.train.batch import PackedBatch

    return PackedBatch(batch.input_ids, batch.cu_seqlens, {k: v for k, v in batch.fields.items()
                                                            if k != "routed_experts"})


def _gap(lp: torch.Tensor, batch) -> dict[str, float]:
    keep = batch.fields["loss_mask"] > 0
    d = (lp - batch.fields["behav_logprobs"]).abs()[keep].double()
    return {"mean": float(d.mean()), "p99": float(d.quantile(0.99)), "max": float(d.max())}


def _loss(logp, mb, normalizer):
    from realscale.algo.losses import ppo_loss

    f = mb.fields
    return ppo_loss(logp, f["behav_logprobs"], f["advantages"], f["loss_mask"], eps_clip=0.2, normalizer=normalizer)


def trainer_side(model: str, runs: dict[str, list[dict]], reps: int) -> dict:
    """On one spawned rank: log-prob gaps per server dtype, then time of the forward and of
    a PPO step with and without replay (alternating, median of ``reps``)."""
    from realscale.models.family import load_arch
    from realscale.train.engine import EngineConfig, MegatronEngine

    arch = load_arch(model)
    width = arch.num_layers * arch.moe.topk
    eng = MegatronEngine(EngineConfig(model_path=model, lr=1e-5, routing_replay=True, max_tokens_per_micro_batch=2048,
                                      moe_aux_loss_coef=0.0))
    out: dict = {"gap": {}, "flips": {}}
    for dtype, samples in runs.items():
        batch = _batch(samples, width)
        out["gap"][dtype] = {"own_routing": _gap(eng.logprobs(_without_routing(batch))["logprobs"], batch),
                             "replayed": _gap(eng.logprobs(batch)["logprobs"], batch)}
        out["flips"][dtype] = _flips(model, samples, width)
    batch = _batch(runs["bfloat16"], width)
    plain = _without_routing(batch)
    times: dict[str, list[float]] = {"logprobs_own": [], "logprobs_replayed": [], "step_own": [], "step_replayed": []}
    for _ in range(reps):
        for name, b in (("own", plain), ("replayed", batch)):
            t0 = time.perf_counter()
            eng.logprobs(b)
            times[f"logprobs_{name}"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.train_step(b, _loss)
            times[f"step_{name}"].append(time.perf_counter() - t0)
    out["seconds"] = {k: statistics.median(v) for k, v in times.items()}
    out["tokens"] = batch.num_tokens
    out["routing_bytes"] = int(batch.fields["routed_experts"].numel() * 4)  # int32 per token x layer x top-k
    out["routing_bytes_per_token"] = width * 4
    return out


def _flips(model: str, samples: list[dict], width: int) -> float:
    """Share of (position, layer) whose server-chosen expert set differs from the fp32
    reference router's (transformers' Qwen3-MoE, which the trainer matches)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    k = hf.config.num_experts_per_tok
    differ = total = 0
    with torch.no_grad():
        for s in samples:
            ids = s["prompt"] + s["out"][:-1]
            logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
            ref = torch.stack([lg.view(len(ids), -1).topk(k, -1).indices for lg in logits], 1).sort(-1).values
            got = torch.as_tensor(s["routed"]).view(len(ids), -1, k).sort(-1).values
            differ += int((ref != got).any(-1).sum())
            total += ref.shape[0] * ref.shape[1]
    return differ / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 250, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as root:
        model = build_model(root)
        runs = {dtype: sample(model, dtype, prompts, args.new_tokens) for dtype in ("bfloat16", "float32")}
        res = run_distributed(trainer_side, 1, model, runs, args.reps, timeout=1800)[0]
    res.update(prompts=args.prompts, new_tokens=args.new_tokens, reps=args.reps, model={"hidden": 128, "layers": 4, **MOE},
               load=os.getloadavg()[0])
    print(f"{'server':9} {'routing flips':>13} {'gap own (mean/p99/max)':>28} {'gap replayed (mean/p99/max)':>31}")
    for dtype in ("bfloat16", "float32"):
        o, r = res["gap"][dtype]["own_routing"], res["gap"][dtype]["replayed"]
        print(f"{dtype:9} {res['flips'][dtype]:13.4f} {o['mean']:9.2e}/{o['p99']:8.2e}/{o['max']:8.2e} "
              f"{r['mean']:10.2e}/{r['p99']:8.2e}/{r['max']:8.2e}")
    s = res["seconds"]
    print(f"log-probs {s['logprobs_own']:.3f} s -> {s['logprobs_replayed']:.3f} s replayed; PPO step "
          f"{s['step_own']:.3f} s -> {s['step_replayed']:.3f} s; routing {res['routing_bytes_per_token']} B/token "
          f"({res['routing_bytes'] / 1e6:.2f} MB for {res['tokens']} tokens)")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

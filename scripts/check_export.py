"""Does a run's HF export (``<run>/final``) give the Megatron engine's log-probs?

Loads the run's last checkpoint into the Megatron engine (the run's own tp/pp layout, from
``<run>/config.yaml``) and the exported directory into transformers, scores the same
token sequences with both (the held-out prompts with the final evaluation's answers, or
the training prompts), and prints the largest absolute difference of per-token log-probs.

    python scripts/check_export.py runs/smollm2_gsm8k [--sequences 8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _sequences(run: str, model_dir: str, n: int) -> list[list[int]]:
    """Prompt + answer token ids from the final evaluation's records, else training prompts."""
    from transformers import AutoTokenizer

    from realscale.eval.benchmark import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    path = os.path.join(run, "eval_final", "per_problem.jsonl")
    seqs = []
    if os.path.isfile(path):
        for line in open(path, encoding="utf-8"):
            rec = json.loads(line)
            seqs.append(encode_prompt(tok, rec["prompt"]) + tok.encode(rec["completions"][0], add_special_tokens=False))
            if len(seqs) == n:
                break
    if not seqs:
        for line in open(os.path.join(run, "trained_uids.jsonl"), encoding="utf-8"):
            seqs.append(tok.encode(line))
            if len(seqs) == n:
                break
    return seqs


def _megatron_logprobs(cfg_dict: dict[str, Any], ckpt: str, model_dir: str, seqs: list[list[int]]) -> Any:
    import torch

    from realscale.config import config_from_dict
    from realscale.train.batch import PackedBatch
    from realscale.train.engine import EngineConfig, MegatronEngine

    cfg = config_from_dict(cfg_dict)
    cfg.parallel.dp = 1
    eng = MegatronEngine(EngineConfig.from_config(cfg, model_dir, train=False))
    eng.load(ckpt)
    eng.ec.temperature = 1.0  # compare raw log-probs, as HF gives them
    out = eng.logprobs(PackedBatch.from_sequences([torch.tensor(s) for s in seqs]))["logprobs"]
    return out


def main(argv: list[str] | None = None) -> int:
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from realscale.parallel.spawn import run_distributed
    from realscale.train.checkpoint import latest_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="run directory (holds config.yaml, latest_checkpoint, final/)")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    cfg_dict = OmegaConf.to_container(OmegaConf.load(os.path.join(args.run, "config.yaml")))
    final, ckpt = os.path.join(args.run, "final"), latest_checkpoint(args.run)
    if ckpt is None or not os.path.isfile(os.path.join(final, "config.json")):
        print(f"{args.run}: needs a checkpoint and an HF export in final/", file=sys.stderr)
        return 2
    seqs = _sequences(args.run, final, args.sequences)
    world = cfg_dict["parallel"]["tp"] * cfg_dict["parallel"]["pp"]
    ours = [r for r in run_distributed(_megatron_logprobs, world, cfg_dict, ckpt, final, seqs, timeout=3600)
            if r is not None][0]
    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    ref = []
    with torch.no_grad():
        for s in seqs:
            logp = torch.log_softmax(hf(torch.tensor([s])).logits[0].float(), -1)
            ref.append(torch.cat([torch.zeros(1), logp[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0]]))
    ref_t = torch.cat(ref)
    diff = (ours.float() - ref_t).abs()
    firsts = torch.cumsum(torch.tensor([0] + [len(s) for s in seqs[:-1]]), 0)
    diff[firsts] = 0.0  # a sequence's first token has no log-prob
    result = {"run": args.run, "checkpoint": ckpt, "export": final, "sequences": len(seqs),
              "tokens": int(ref_t.numel()), "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

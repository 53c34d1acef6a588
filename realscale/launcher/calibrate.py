"""Measure a hardware profile on this machine and fit the cost model's constants to it.

``realscale profile`` runs :func:`measure_cpu_profile`: short micro-measurements of the
real components, each with the thread count a run gives them (one torch thread for the
embedded server and one for a single trainer rank on a 2-core machine).

**What is timed: the CPU time of the process doing the work** (the server process for
decode steps, the trainer rank for train steps, this process for the device), not the wall
clock. The runs the simulator is validated on (``benchmarks/bench_async.py``, load average
1.2-2.0: their own processes, one core each for the server and the trainer) ran on an
otherwise idle machine; this machine is shared, and a wall-clock profile taken at load 10
measured decode steps 2-3x slower than the same server's idle rate
(``benchmarks/results/server_concurrency.json``), so it described the other jobs, not the
components. CPU time is what a component costs when it has its core, which is what it had
in those runs. Every point is repeated and its quickest repetition kept (context switches
under load still inflate CPU time a little); wall-clock times are kept beside them. The
weight sync spans two processes and HTTP, so it is timed by the wall clock.

- **device**: one-thread fp32 matmul GFLOP/s (``gpu.peak_tflops``) and memory-copy
  bandwidth (``gpu.hbm_tbps``, and the "links" of one machine);
- **decode**: a real embedded generation server (``realscale serve``) answering ``b``
  concurrent requests of prompt length ``P`` through the real client, each forced to
  ``N1`` and then ``N2`` new tokens (``ignore_eos``); the step time at batch ``b`` and mean
  context ``P + (N1 + N2) / 2`` is ``(T(N2) - T(N1)) / (N2 - N1)`` (request overheads and
  prefill cancel);
- **train**: the Megatron engine of the recipe's model (``realscale.train.actor.update_policy``:
  proximal log-probs + PPO mini-batch updates, the recipe's micro-batch budget) on packed
  batches of ``T`` tokens in ``mb`` mini-batches;
- **requests**: ``b`` concurrent requests of a 4-token prompt for one new token; the slope
  of the server's CPU time over ``b`` is its cost per request (HTTP, JSON, scheduling: in
  one process with the engine and its GIL, it holds up decoding), the client's CPU time
  per request is kept beside it;
- **rollout side**: the run's real rollout controller, workflow and reward workers
  (:func:`realscale.rollout.factory.build_controller`) against that server for
  :data:`ROLLOUT_SECONDS`, no trainer, the all-equal filter off (a random-weight model
  fails every sample alike): their CPU time per finished request
  (``eff.client_request_cpu_s``), the host CPU each request costs outside the server; with
  ``gpu.host_cores`` (this machine's CPUs) the simulator makes the roles share the cores;
- **weight sync**: the trainer's real update path into that server
  (:class:`realscale.publish.publisher.WeightPublisher` with the transport
  ``generate.weight_update`` selects: for the embedded server the resharder; pause in the
  recipe's pause mode, move, resume).

Then the cost model's constants are fitted to them (:func:`fit_profile`, least squares on
log times): ``eff.decode_step_overhead_s``, ``eff.decode_seq_overhead_s``,
``eff.decode_ctx_overhead_s`` and ``eff.mfu_decode`` to the decode steps through
:func:`realscale.planner.cost.decode_step_seconds`; ``eff.mfu_train`` and
``eff.train_step_overhead_s`` to the train steps through
:func:`realscale.planner.cost.train_cost`; ``eff.request_overhead_s`` to the requests
(:func:`robust_line`); ``eff.mfu_prefill`` to the first-token times less that;
``eff.weight_update_overhead_s`` to the sync. The raw measurements are kept in the profile
so a reader can refit or check them. The fit never sees a whole RL run.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import random
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from realscale.data.tokens import prompt_ids
from realscale.launcher.local import start_servers, stop_servers
from realscale.models.tokenizer import load_tokenizer
from realscale.parallel.mesh import Strategy
from realscale.parallel.model_spec import spec_from_hf_config
from realscale.parallel.spawn import run_distributed
from realscale.planner import cost as C
from realscale.planner.hardware import GPU, Efficiency, HardwareProfile, Source

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.inference.client import InferenceClient
    from realscale.train.engine import MegatronEngine

DECODE_BATCHES = (1, 4, 16, 32, 64)
DECODE_PROMPTS = (16, 160, 320)
DECODE_NEW = (8, 136)
REQUEST_BATCHES = (1, 8, 32, 64)
TRAIN_POINTS = ((1024, 96, 1), (2048, 96, 1), (4096, 96, 1), (2048, 32, 4), (4096, 32, 4), (8192, 32, 4))


# ----------------------------------------------------------------------------- fitting


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.5, iters: int = 400,
                tol: float = 1e-9) -> tuple[np.ndarray, float]:
    """Minimise ``f`` from ``x0`` (the downhill simplex; no scipy dependency)."""
    n = len(x0)
    pts = [np.asarray(x0, np.float64)] + [np.asarray(x0, np.float64) + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) <= tol * (1 + abs(vals[0])):
            break
        centroid = np.mean(pts[:-1], axis=0)
        refl = centroid + (centroid - pts[-1])
        fr = f(refl)
        if fr < vals[0]:
            exp = centroid + 2 * (centroid - pts[-1])
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = centroid + 0.5 * (pts[-1] - centroid)
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    best = int(np.argmin(vals))
    return pts[best], float(vals[best])


def robust_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of ``y = a + b x`` by Siegel's repeated median (for each point the
    median slope to the others, then their median; then the median intercept), both clipped
    at 0: up to half the points slowed by bursts of load from other processes do not tilt it."""
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        raise ValueError("a line fit needs measurements at two or more sizes")
    per_point = []
    for i, (x1, y1) in enumerate(points):
        slopes = [(y2 - y1) / (x2 - x1) for j, (x2, y2) in enumerate(points) if j != i and x2 != x1]
        if slopes:
            per_point.append(statistics.median(slopes))
    b = max(0.0, statistics.median(per_point))
    return max(0.0, statistics.median([y - b * x for x, y in points])), b


def _log_sq(pred: list[float], meas: list[float]) -> float:
    return float(sum((math.log(p) - math.log(m)) ** 2 for p, m in zip(pred, meas)))


def fit_profile(name: str, spec: Any, device: dict[str, float], decode: list[dict[str, float]],
                train: list[dict[str, float]], sync: dict[str, float], train_settings: dict[str, int],
                meta: dict[str, Any] | None = None, requests: list[dict[str, float]] | None = None,
                rollout: dict[str, float] | None = None) -> HardwareProfile:
    """A :class:`HardwareProfile` whose cost-model predictions fit these measurements
    (``requests``: the per-request points; without them the per-request cost is fitted
    jointly with the prefill cost to the first-token times)."""

    gpu = GPU(name, peak_tflops=device["matmul_gflops"] / 1e3, hbm_gb=device["memory_gb"],
              hbm_tbps=device["copy_gbps"] / 1e3, nvlink_gbps=device["copy_gbps"], ib_gbps=device["copy_gbps"],
              pcie_gbps=device["copy_gbps"], host_cores=float(device.get("cpus", 0)) if rollout else 0.0)
    base = Efficiency(hbm_decode=1.0, link=1.0, tp_overhead=0.0, collective_latency_s=0.0)

    def decode_eff(x: np.ndarray) -> Efficiency:
        return Efficiency(**{**base.__dict__, "decode_step_overhead_s": math.exp(x[0]),
                             "decode_seq_overhead_s": math.exp(x[1]), "mfu_decode": min(1.0, math.exp(x[2])),
                             "decode_ctx_overhead_s": math.exp(x[3])})

    def decode_err(x: np.ndarray) -> float:
        eff = decode_eff(x)
        return _log_sq([C.decode_step_seconds(spec, 1, d["batch"], d["ctx"], gpu, eff) for d in decode],
                       [d["step_s"] for d in decode])

    xd, _ = nelder_mead(decode_err, np.log([1e-3, 1e-5, 0.1, 1e-8]), step=1.0, iters=1200)
    eff = decode_eff(xd)

    def train_eff(x: np.ndarray) -> Efficiency:
        return Efficiency(**{**eff.__dict__, "mfu_train": min(1.0, math.exp(x[0])),
                             "train_step_overhead_s": math.exp(x[1])})

    def train_pred(e: Efficiency, t: dict[str, float]) -> float:
        n = int(t["tokens"] // t["seq_len"])
        w = C.Workload(batch=n, n_samples=1, prompt_len=max(1, int(t["prompt_len"])),
                       gen_len=int(t["seq_len"] - t["prompt_len"]), mean_gen_len=int(t["seq_len"] - t["prompt_len"]),
                       train_mb_tokens=train_settings["train_mb_tokens"], minibatches=int(t["minibatches"]),
                       logprob_chunk_tokens=train_settings["logprob_chunk_tokens"])
        return C.train_cost(spec, Strategy(1, 1, 1), w, gpu, e, 1).seconds

    xt, _ = nelder_mead(lambda x: _log_sq([train_pred(train_eff(x), t) for t in train], [t["seconds"] for t in train]),
                        np.log([0.1, 0.05]), step=1.0, iters=600)
    eff = train_eff(xt)
    # first-token time = requests x overhead + prompt tokens x prefill cost
    if requests:
        _, per_request = robust_line([(r["batch"], r["server_cpu_s"]) for r in requests])
        _, per_token = robust_line([(d["prefill_tokens"], d["prefill_s"] - d["batch"] * per_request) for d in decode])
    else:
        a = np.array([[d["batch"], d["prefill_tokens"]] for d in decode], np.float64)
        (per_request, per_token), *_ = np.linalg.lstsq(a, np.array([d["prefill_s"] for d in decode]), rcond=None)
    per_token = max(float(per_token), 1e-9)
    mfu = C.fwd_flops_per_token(spec, DECODE_PROMPTS[1]) / (gpu.peak_tflops * 1e12 * per_token)
    eff = Efficiency(**{**eff.__dict__, "mfu_prefill": min(1.0, mfu), "request_overhead_s": max(0.0, float(per_request))})
    transfer = spec.n_params * spec.itemsize / (gpu.nvlink_gbps * 1e9 * eff.link)
    eff = Efficiency(**{**eff.__dict__, "weight_update_overhead_s": max(0.0, sync["seconds"] - transfer),
                        "client_request_cpu_s": rollout["client_cpu_per_request_s"] if rollout else 0.0})
    m = "measured on this machine by `realscale profile`, CPU time"
    f = "fitted (least squares on log times) to the decode steps `realscale profile` measured (server CPU time)"
    sources = {"gpu.peak_tflops": Source("measured", f"one-thread fp32 matmul ({m})"),
               "gpu.hbm_gb": Source("measured", "total RAM"),
               "gpu.hbm_tbps": Source("measured", f"one-thread memory copy ({m})"),
               "gpu.nvlink_gbps": Source("measured", "memory copy: one machine has no link"),
               "gpu.ib_gbps": Source("measured", "memory copy: one machine has no link"),
               "gpu.pcie_gbps": Source("measured", "memory copy"),
               "gpu.host_cores": Source("measured", "os.cpu_count(): every role of a run shares them")
               if rollout else Source("assumed", "0: no rollout-side measurement, the host is not modelled as shared"),
               "eff.client_request_cpu_s": Source("measured", "CPU time of the real rollout controller, workflow and "
                                                              "reward workers per finished request")
               if rollout else Source("assumed", "0: not measured"),
               "eff.hbm_decode": Source("assumed", "1: the copy bandwidth is the attainable one"),
               "eff.link": Source("assumed", "1: loopback gloo; the sync's rest is in weight_update_overhead_s"),
               "eff.tp_overhead": Source("assumed", "0: one rank"),
               "eff.collective_latency_s": Source("assumed", "0: one rank"),
               "eff.recompute_cost": Source("assumed", "not measured on CPU (the CPU recipes do not recompute)"),
               "eff.decode_step_overhead_s": Source("fitted", f),
               "eff.decode_seq_overhead_s": Source("fitted", f),
               "eff.decode_ctx_overhead_s": Source("fitted", f),
               "eff.mfu_decode": Source("fitted", f),
               "eff.mfu_train": Source("fitted", "fitted to the Megatron train steps `realscale profile` measured (CPU time)"),
               "eff.train_step_overhead_s": Source("fitted", "fitted to the Megatron train steps"),
               "eff.mfu_prefill": Source("fitted", "first-token times: linear fit over requests and prompt tokens"),
               "eff.request_overhead_s": Source("fitted", "server CPU time over concurrent 1-token requests: slope"
                                                          if requests else "first-token times: linear fit over "
                                                          "requests and prompt tokens"),
               "eff.weight_update_overhead_s": Source("measured", "quickest pause + weight move (the recipe's "
                                                                  "transport) + resume, less the bytes at copy "
                                                                  "bandwidth")}
    measurements = {"device": device, "decode": decode, "train": train, "sync": sync,
                    "train_settings": train_settings, **({"requests": requests} if requests else {}),
                    **({"rollout": rollout} if rollout else {}), **(meta or {})}
    return HardwareProfile(name, gpu, eff, sources, measurements)


# ----------------------------------------------------------------------------- device


def measure_device(threads: int = 1) -> dict[str, float]:
    """One-thread matmul GFLOP/s and memory-copy GB/s; total RAM."""
    import psutil
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    reps = 20
    t = min(_times(lambda: [a @ b for _ in range(reps)], 5, time.process_time))
    gflops = 2 * 512 ** 3 * reps / t / 1e9
    src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    t = min(_times(lambda: dst.copy_(src), 7, time.process_time))
    return {"matmul_gflops": gflops, "copy_gbps": 2 * src.numel() / t / 1e9,  # read + write
            "memory_gb": psutil.virtual_memory().total / 1e9, "threads": threads, "cpus": os.cpu_count() or 1}


def _times(fn: Callable[[], Any], repeats: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def _process_cpu(pid: int) -> Callable[[], float]:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    import psutil

    proc = psutil.Process(pid)

    def cpu() -> float:
        t = proc.cpu_times()
        return t.user + t.system

    return cpu


# ----------------------------------------------------------------------------- decode


async def _timed_batch(client: InferenceClient, batch: int, prompt: int, new: int, vocab: int, seed: int,
                       server_cpu: Callable[[], float]) -> tuple[float, float, float]:
    """(server CPU seconds, wall seconds, this client's CPU seconds) of one batch of requests."""
    rng = np.random.default_rng(seed)
    params = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
    prompts = [rng.integers(3, vocab, prompt).tolist() for _ in range(batch)]
    c0, t0, k0 = server_cpu(), time.perf_counter(), time.process_time()
    await asyncio.gather(*(client.generate(p, dict(params)) for p in prompts))
    return server_cpu() - c0, time.perf_counter() - t0, time.process_time() - k0


async def _request_points(url: str, vocab: int, repeats: int, server_cpu: Callable[[], float],
                          rounds: int = 8) -> list[dict[str, float]]:
    """``b`` concurrent requests of a 4-token prompt for 1 new token, ``rounds`` times in a
    row per timing (the kernel counts CPU time in 10 ms ticks), each ``b`` ``repeats`` times
    (shuffled); per round, the quickest server CPU, client CPU and wall time of each ``b``."""

    from realscale.inference.client import InferenceClient

    runs = [(b, r) for b in REQUEST_BATCHES for r in range(repeats)]
    random.Random(1).shuffle(runs)
    got: dict[int, list[tuple[float, float, float]]] = {}
    async with InferenceClient([url]) as client:
        for b, r in runs:
            total = [0.0, 0.0, 0.0]
            for k in range(rounds):
                for i, x in enumerate(await _timed_batch(client, b, 4, 1, vocab, 1000 + rounds * r + k, server_cpu)):
                    total[i] += x / rounds
            got.setdefault(b, []).append((total[0], total[1], total[2]))
    return [{"batch": b, "server_cpu_s": min(t[0] for t in got[b]), "wall_s": min(t[1] for t in got[b]),
             "client_cpu_s": min(t[2] for t in got[b])} for b in REQUEST_BATCHES]


async def _decode_points(url: str, vocab: int, repeats: int, server_cpu: Callable[[], float]) -> list[dict[str, float]]:
    """Every (batch, prompt, new tokens) point ``repeats`` times in a shuffled order (a burst
    of load from other processes then spreads over all points instead of biasing one);
    the quickest of each is kept (server CPU time; wall time beside it)."""

    from realscale.inference.client import InferenceClient

    n1, n2 = DECODE_NEW
    runs = [(b, p, n, r) for b in DECODE_BATCHES for p in DECODE_PROMPTS for n in DECODE_NEW for r in range(repeats)]
    random.Random(0).shuffle(runs)
    cpu: dict[tuple[int, int, int], list[float]] = {}
    wall: dict[tuple[int, int, int], list[float]] = {}
    async with InferenceClient([url]) as client:
        await _timed_batch(client, 4, 16, 8, vocab, 0, server_cpu)  # warm-up
        for b, p, n, r in runs:
            c, w, _ = await _timed_batch(client, b, p, n, vocab, r, server_cpu)
            cpu.setdefault((b, p, n), []).append(c)
            wall.setdefault((b, p, n), []).append(w)
    out = []
    for b in DECODE_BATCHES:
        for p in DECODE_PROMPTS:
            t1, t2 = min(cpu[(b, p, n1)]), min(cpu[(b, p, n2)])
            step = max(1e-6, (t2 - t1) / (n2 - n1))
            w1, w2 = min(wall[(b, p, n1)]), min(wall[(b, p, n2)])
            out.append({"batch": b, "prompt": p, "ctx": p + (n1 + n2) / 2, "step_s": step,
                        "tokens_per_s": b / step, "prefill_tokens": b * p, "prefill_s": max(0.0, t1 - n1 * step),
                        "t_n1": t1, "t_n2": t2, "wall_step_s": max(1e-6, (w2 - w1) / (n2 - n1))})
    return out


# ----------------------------------------------------------------------------- train + sync (a trainer rank)


def _packed(vocab: int, tokens: int, seq_len: int, prompt_len: int, seed: int) -> Any:
    import torch

    from realscale.train.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    n = tokens // seq_len
    seqs = [torch.randint(3, vocab, (seq_len,), generator=g) for _ in range(n)]
    ans = seq_len - prompt_len
    mask = [torch.cat([torch.zeros(prompt_len), torch.ones(ans)]) for _ in range(n)]
    behav = [torch.cat([torch.zeros(prompt_len), -2.0 + 0.3 * torch.randn(ans, generator=g)]) for _ in range(n)]
    adv = [torch.full((seq_len,), float(torch.randn((), generator=g))) for _ in range(n)]
    return PackedBatch.from_sequences(seqs, {"loss_mask": mask, "behav_logprobs": behav, "advantages": adv})


def _trainer_rank(cfg: Config, model_dir: str, url: str, threads: int, repeats: int, prompt_len: int) -> dict[str, Any]:
    """Runs in a spawned rank: train-step and weight-sync timings with the real engine."""

    import torch

    from realscale.train.actor import split_for_dp, update_policy
    from realscale.train.engine import EngineConfig, MegatronEngine

    torch.set_num_threads(threads)
    engine = MegatronEngine(EngineConfig.from_config(cfg, model_dir))
    vocab = engine.arch.vocab_size
    train = []
    for i, (tokens, seq_len, mb) in enumerate(TRAIN_POINTS):
        c = copy.deepcopy(cfg)
        c.train.mini_batches = mb
        batch = split_for_dp(_packed(vocab, tokens, seq_len, min(prompt_len, seq_len // 2), i), mb, 1)[0]
        update_policy(engine, batch, c)  # warm-up
        cpu = _times(lambda: update_policy(engine, batch, c), repeats, time.process_time)
        wall = _times(lambda: update_policy(engine, batch, c), repeats)
        train.append({"tokens": tokens, "seq_len": seq_len, "prompt_len": min(prompt_len, seq_len // 2),
                      "minibatches": mb, "seconds": min(cpu), "wall_seconds": min(wall)})

    times = _sync_times(cfg, engine, url, repeats)
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return {"train": train, "sync": {"seconds": min(times), "median_seconds": statistics.median(times),
                                     "all": times, "bytes": nbytes, "weight_update": cfg.generate.weight_update,
                                     "pause_mode": cfg.generate.pause_mode}}


def _sync_times(cfg: Config, engine: MegatronEngine, url: str, repeats: int) -> list[float]:
    """Weight updates through the trainer's own publisher (pause -> move -> resume), the
    first (which connects the transport) left out."""

    from realscale.publish.control import ClientControl, ServerEndpoint
    from realscale.publish.publisher import WeightPublisher, transport_for

    control = ClientControl([ServerEndpoint(url, 1)])
    publisher = WeightPublisher(transport_for(cfg, tempfile.mkdtemp(prefix="profile-weights-")), control,
                                cfg.generate.pause_mode)
    try:
        times = []
        for v in range(1, repeats + 2):
            t0 = time.perf_counter()
            publisher.publish(engine, v)
            times.append(time.perf_counter() - t0)
        return times[1:]
    finally:
        publisher.close()
        control.close()


ROLLOUT_SECONDS = 30.0
ROLLOUT_MAX_NEW = 64  # answers of a random-weight model run to the cap; keep them near a real run's length


def _rollout_cpu(cfg: Config, model_dir: str, url: str, work_dir: str, server_pid: int,
                 seconds: float = ROLLOUT_SECONDS) -> dict[str, float]:
    """The run's real rollout side (controller, workflow, reward workers) against the server
    for ``seconds`` at the recipe's concurrency (no staleness limit, no trainer): CPU time of
    this process (the controller's thread) and its children other than the server (the
    reward workers), per finished request."""

    import psutil

    from realscale.rollout.factory import build_controller

    c = copy.deepcopy(cfg)
    c.rollout.max_staleness = 1 << 20  # keep max_concurrent groups in flight
    # A random-weight model answers nearly every group all-wrong, so DAPO's filter would
    # drop almost all of them and one get_batch would wait minutes (91 s measured for the
    # tiny recipe) or time out. Its cost per group is one small tensor op; the figure is
    # per finished request, filtered or not, so measure with it off.
    c.rollout.filter_all_equal = False
    c.generate.max_new_tokens = ROLLOUT_MAX_NEW
    me = psutil.Process()

    def client_cpu() -> float:
        procs = [me] + [p for p in me.children(recursive=True) if p.pid != server_pid]
        total = 0.0
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # a worker that just exited: its time is lost either way
                pass
        return total

    ctl = build_controller(c, model_dir, [url], os.path.join(work_dir, "rollout"))
    ctl.start()
    try:
        ctl.get_batch(c.rollout.batch_size, timeout=600)  # reward workers up, pipeline full
        before, t0, server0 = ctl.stats(), time.perf_counter(), _process_cpu(server_pid)()
        cpu0 = client_cpu()
        while time.perf_counter() - t0 < seconds:
            ctl.get_batch(c.rollout.batch_size, timeout=600)
        cpu1, after = client_cpu(), ctl.stats()
        wall, server = time.perf_counter() - t0, _process_cpu(server_pid)() - server0
    finally:
        ctl.stop()
    groups = (after["submitted"] - after["running"]) - (before["submitted"] - before["running"])  # finished
    requests = max(1, groups * c.rollout.n_samples)
    return {"seconds": wall, "requests": requests, "client_cpu_s": cpu1 - cpu0, "server_cpu_s": server,
            "client_cpu_per_request_s": (cpu1 - cpu0) / requests,
            "generated_tokens": after.get("generated_tokens", 0) - before.get("generated_tokens", 0)}


def measure_cpu_profile(recipe: str, work_dir: str, *, threads: int = 1, repeats: int = 5,
                        name: str = "cpu", rollout_seconds: float = ROLLOUT_SECONDS) -> HardwareProfile:
    """Measure this machine with the recipe's model (see the module docstring) and fit;
    the rollout side is measured over ``rollout_seconds`` (to the next batch boundary)."""
    from realscale.config import load_config
    from realscale.sft import build_base_model

    cfg = load_config(recipe)
    os.makedirs(work_dir, exist_ok=True)
    model_dir = os.path.join(work_dir, "model")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        build_base_model(cfg, model_dir)  # the recipe's warm-start architecture; timing ignores the weights

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        hf = json.load(fh)
    spec = spec_from_hf_config(hf, itemsize=4 if cfg.model.dtype == "float32" else 2)
    tokenizer = load_tokenizer(model_dir)
    prompt_len = len(prompt_ids(tokenizer, "7 4"))
    device = measure_device(threads)
    servers = start_servers(model_dir, 1, os.path.join(work_dir, "logs"), threads=threads, max_running=max(DECODE_BATCHES),
                            context_length=max(DECODE_PROMPTS) + max(DECODE_NEW) + 8)
    try:
        server_cpu = _process_cpu(servers[0].proc.pid)
        decode = asyncio.run(_decode_points(servers[0].url, int(hf["vocab_size"]), repeats, server_cpu))
        requests = asyncio.run(_request_points(servers[0].url, int(hf["vocab_size"]), repeats, server_cpu))
        rollout = _rollout_cpu(cfg, model_dir, servers[0].url, work_dir, servers[0].proc.pid, rollout_seconds)
        rank = run_distributed(_trainer_rank, 1, cfg, model_dir, servers[0].url, threads, repeats, prompt_len,
                               timeout=1800)[0]
    finally:
        stop_servers(servers)
    settings = {"train_mb_tokens": cfg.train.max_tokens_per_micro_batch,
                "logprob_chunk_tokens": cfg.train.logprob_chunk_tokens}
    meta = {"recipe": recipe, "model": {k: hf[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                             "num_key_value_heads", "intermediate_size", "vocab_size")},
            "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M")}
    return fit_profile(name, spec, device, decode, rank["train"], rank["sync"], settings, meta, requests, rollout)

"""Measured capacity of one rollout process (issue 30 item 2).

    python benchmarks/bench_rollout_tier.py            # ~5 min; writes benchmarks/results/rollout_tier.json
    python benchmarks/bench_rollout_tier.py derive     # ~1 min: the simulator's AReaL workloads with that cost

The shipped 7B/32B plans generate on 36 SGLang servers of 256 decode slots. Here a fleet of
36 load servers x 256 slots (``benchmarks/_load_fleet.py``: SGLang's ``/generate`` reply,
scripted decode, no model) runs in a process of its own, and the rollout side in another,
as :class:`realscale.rollout.process.ControllerProcess` runs it: the real
``RolloutController`` and ``InferenceClient``, the single-turn workflow (chat template,
decode, math reward in ``reward.workers`` processes), ``get_batch`` + ``pack_groups_raw``, the
batch's numpy arrays sent over a pipe as raw bytes (this process makes the tensors). This process plays trainer rank 0:
take a batch, train (``--train-s`` of sleep), pause the rollouts and the servers (abort),
load the next weight version, set it, resume (``ServerControl``'s order).

Each case has two phases:

1. **hold** — every request decodes at ``--hold-rate`` tokens/s (a 7B SGLang server with 256
   running requests makes a few thousand tokens/s, so a request a few tens); almost nothing
   finishes in the window. The fleet counts the requests it holds (running or queued):
   what the client keeps on the servers, and what holding them costs the rollout process.
2. **ingest** — the fleet's rate is raised to ``--ingest-rate`` for every request (time
   runs ~16x faster than on the cluster, so that answers of the real length, lognormal
   median 6,445 tokens as calibrated on the AReaL figures, finish within seconds): the
   rollout process is saturated, and what it ingests is its ceiling on this machine. Its
   CPU seconds per generated token and per answer do not depend on that speed-up.

Cases (``--cases``): ``pool256`` is the client before issue 30 item 1 (one aiohttp pool of
256 connections in all, ``TCPConnector(limit=256, limit_per_host=256)`` as at 0b9762f^,
emulated by overriding ``InferenceClient.start``); ``per_server`` is today's client
(``client_kwargs(cfg)``: 2 x ``generate.max_running_requests`` connections per server, no
total cap); both with the lognormal lengths, and ``per_server`` again with the long-tail
task's law (n^-1.5, ``configs/long_tail_cpu.yaml``) stretched to the 27,648-token cap,
which has ~1.6x more answers per token. From the two ``per_server`` cases, CPU = a x
answers + b x tokens gives the cost per answer and per token apart. ``sharded2`` is the
rollout side scaled out (:class:`realscale.rollout.sharded.ShardedRollouts`): two rollout
processes, each with 18 of the servers, half the prompts and half of every batch. Every
case's client connects with ``--connect-timeout`` 60 s, not today's 5 s: with 9,216
connections opened at once the client's own event loop falls seconds behind, its 5-s
connect timers fire, and it takes every server out of rotation (BENCHMARKS.md).

``derive`` runs the simulator's AReaL workloads (1.5B/7B/32B to 1,024 GPUs) with the
measured cost (:class:`realscale.sim.des.RolloutModel`): the load of the busiest rollout
process, the largest cluster one process feeds with 2x headroom, and the processes that
feed 1,024 GPUs with it.

CPU is read from ``/proc`` (every thread of the rollout process; its reward workers apart),
not from wall time: the machine has 2 cores and the fleet competes for them. Departures:
the tokenizer is the built-in byte-level one (one token per character; a Qwen2 BPE token
is ~4 characters), the prompts are 60 GSM8K questions cycled, 64 prompts a step instead of
512 (with eta = 8 the staleness rule then admits 576 prompts = 9,216 requests: every slot).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
RESULT = os.path.join(REPO, "benchmarks", "results", "rollout_tier.json")
FLEET = os.path.join(HERE, "_load_fleet.py")
DATA = os.path.join(REPO, "configs", "data", "gsm8k_mgsm.jsonl")
LOGNORMAL = "lognormal:6445:0.33"  # benchmarks/results/sim_calibration.json "lengths" (rounded)
LONG_TAIL = "powerlaw:614:27648:1.5"  # long_tail_cpu.yaml's n^-1.5 on 2..90 steps, x 307 tokens a step
FILLER = "We add the two numbers, then check the result against the question once more. "
CASES = {"pool256": ("pool256", LOGNORMAL, 1), "per_server": ("per_server", LOGNORMAL, 1),  # (client, lengths, processes)
         "per_server_long_tail": ("per_server", LONG_TAIL, 1), "sharded2": ("per_server", LOGNORMAL, 2)}


@dataclass(frozen=True)
class Settings:
    servers: int
    slots: int
    batch: int
    n_samples: int
    eta: int
    max_concurrent: int
    max_new_tokens: int
    reward_workers: int
    hold_rate: float
    ingest_rate: float
    hold_s: float
    update_every: float
    settle_s: float
    seconds: float
    train_s: float
    backend: str
    connect_timeout: float
    hand_groups: int

    def overrides(self, lengths: str) -> list[str]:
        return [f"generate.backend={self.backend}", f"rollout.batch_size={self.batch}",
                f"rollout.n_samples={self.n_samples}", f"rollout.max_staleness={self.eta}",
                f"rollout.max_concurrent={self.max_concurrent}", f"generate.max_new_tokens={self.max_new_tokens}",
                f"generate.context_length={self.max_new_tokens + 1024}",
                f"generate.max_running_requests={self.slots}", f"generate.num_servers={self.servers}",
                "reward.kind=math", f"reward.workers={self.reward_workers}", f"data.source={DATA}"]


# ---------------------------------------------------------------------- the fleet


def fleet_script(tokenizer: Any, rate: float, slots: int, lengths: str, backend: str) -> dict[str, Any]:
    """The fleet's Script: filler text and answer tails in the tokenizer's ids."""
    from _load_fleet import LengthLaw, Script

    def toks(text: str) -> tuple[tuple[int, str], ...]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return tuple((int(i), tokenizer.decode([i])) for i in ids)

    with open(DATA, encoding="utf-8") as fh:
        answers = sorted({json.loads(line)["answer"] for line in fh if line.strip()})
    tails = tuple(toks(f" So the answer is \\boxed{{{a}}}.") for a in answers)
    return Script(rate, slots, LengthLaw.parse(lengths), toks(FILLER), tails, int(tokenizer.eos_token_id),
                  abort_poll_s=1.0 if backend == "sglang" else 0.0).to_dict()


class FleetProcess:
    """``benchmarks/_load_fleet.py`` as a child process; its stats and rate over HTTP."""

    def __init__(self, script: dict[str, Any], servers: int, backend: str, longest: int, workdir: str) -> None:
        path = os.path.join(workdir, "script.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(script, fh)
        self.proc = subprocess.Popen([sys.executable, FLEET, "--script", path, "--servers", str(servers),
                                      "--dialect", backend, "--longest", str(longest)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_rollout_tier: the fleet did not start (exit {self.proc.wait()})")
        self.urls: list[str] = json.loads(line)["urls"]

    def _call(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.urls[0] + path, data=data, method="GET" if body is None else "POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict[str, Any]:
        return self._call("/fleet/stats")

    def set_rate(self, rate: float) -> None:
        self._call("/fleet/rate", {"rate": rate})

    def reset_peak(self) -> None:
        self._call("/fleet/reset", {})

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------- the rollout process


def _pool256_client(urls: list[str], **kwargs: Any) -> Any:
    """The client as before issue 30 item 1: one pool of 256 connections in all."""
    import aiohttp

    from realscale.inference.client import InferenceClient

    class Pool256Client(InferenceClient):
        async def start(self) -> None:
            if self._session is None:
                conn = aiohttp.TCPConnector(limit=256, limit_per_host=256)
                self._session = aiohttp.ClientSession(connector=conn)
                self._health_task = asyncio.create_task(self._health_loop())

    return Pool256Client(urls, **kwargs)


def _build(spec: dict[str, Any], counts: Any) -> Any:
    """The rollout side as ControllerProcess's child builds it, with the case's client."""
    from transformers import AutoTokenizer

    from realscale.config import load_config
    from realscale.data.dataset import PromptDataset
    from realscale.inference.client import InferenceClient
    from realscale.rollout.controller import RolloutController, client_kwargs
    from realscale.rollout.process import LocalRollouts
    from realscale.rollout.sharded import shard_config
    from realscale.rollout.workflows import workflow_from_config

    rank, world = spec["shard"]
    cfg = shard_config(load_config(None, spec["overrides"]), world, rank)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    dataset = PromptDataset(DATA, seed=0, rank=rank, world=world)
    workflow = workflow_from_config(cfg, tokenizer)
    kwargs = client_kwargs(cfg)
    kwargs.update(connect_timeout=spec["connect_timeout"], dialect=_counting_dialect(kwargs["dialect"], counts))
    urls = spec["urls"]
    make = (lambda: _pool256_client(urls, **kwargs)) if spec["client"] == "pool256" else \
        (lambda: InferenceClient(urls, **kwargs))
    controller = RolloutController.from_config(cfg, make, dataset, _Counted(workflow, counts))
    controller.pause()
    controller.start()
    return LocalRollouts(controller, cfg)


def _counting_dialect(dialect: Any, counts: Any) -> Any:
    """``dialect`` (the client's), counting every reply it parses once: the tokens the
    client takes in, partial answers of an abort pause included. The client parses a reply
    twice (its decode-rate measurement, then the answer), so a reply is marked when counted."""

    class Counting(type(dialect)):  # type: ignore[misc]
        def parse_generate(self, reply: dict[str, Any]) -> Any:
            seg = super().parse_generate(reply)
            if not reply.get("_counted"):
                reply["_counted"] = True
                counts[3] += len(seg.ids)
                counts[4] += 1
            return seg

    return Counting()


class _CountingClient:
    """The controller's client as the workflow sees it, counting every answer it hands over
    (tokens, answers, interruptions) into memory the driver reads."""

    def __init__(self, client: Any, counts: Any) -> None:
        self.client, self.counts = client, counts

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], /) -> Any:
        res = await self.client.generate(input_ids, sampling_params)
        self.counts[0] += len(res.output_ids)
        self.counts[1] += 1
        self.counts[2] += res.num_interruptions
        return res


class _Counted:
    """The workflow, run with a :class:`_CountingClient`."""

    def __init__(self, inner: Any, counts: Any) -> None:
        self.inner, self.counts, self.n_samples = inner, counts, inner.n_samples

    async def run_episode(self, client: Any, sample: Any) -> Any:
        return await self.inner.run_episode(_CountingClient(client, self.counts), sample)


def _send(conn: Any, rb: Any, header: dict[str, Any]) -> None:
    """The batch's arrays as raw bytes behind a small header, as ControllerProcess sends it."""
    from realscale.rollout.process import _send_batch

    _send_batch(conn, rb, header)


def _next_batch(conn: Any, rollouts: Any, n: int, version: int, timeout: float) -> None:
    """get_batch + pack_groups_raw (what ControllerProcess's child runs), then the hand-over."""
    from realscale.rollout.process import pack_groups_raw

    t0 = time.perf_counter()
    groups = rollouts.controller.get_batch(n, timeout=timeout)
    t1 = time.perf_counter()
    rb = pack_groups_raw(groups, rollouts.cfg.algo, version)
    rb.stats.update({"bench/wait_s_max": t1 - t0, "bench/pack_s_max": time.perf_counter() - t1})
    _send(conn, rb, {"synthetic": False})


def synthetic_groups(n: int, n_samples: int, lengths: str, seed: int = 0) -> list[Any]:
    """``n`` groups of ``n_samples`` answers with lengths drawn from ``lengths``, as the
    workflow builds them (for timing the hand-over of a batch of the recipe's size)."""
    import random

    from _load_fleet import LengthLaw

    from realscale.data.groups import Group, Trajectory

    rng, law = random.Random(seed), LengthLaw.parse(lengths)
    groups = []
    for g in range(n):
        trajs = []
        for _ in range(n_samples):
            k = min(law.draw(rng), 27648)
            trajs.append(Trajectory(prompt_ids=list(range(100)), output_ids=[7] * k, output_logprobs=[-0.5] * k,
                                    output_versions=[0] * k, loss_mask=[1] * k, reward=float(rng.random() < 0.5),
                                    group_id=str(g)))
        groups.append(Group(trajs, uid=str(g)))
    return groups


def _hand_synthetic(conn: Any, rollouts: Any, n: int, lengths: str) -> None:
    """pack_groups_raw + the hand-over of ``n`` synthetic groups."""
    from realscale.rollout.process import pack_groups_raw

    groups = synthetic_groups(n, rollouts.cfg.rollout.n_samples, lengths)
    t0 = time.perf_counter()
    rb = pack_groups_raw(groups, rollouts.cfg.algo, 0)
    rb.stats.update({"bench/wait_s_max": 0.0, "bench/pack_s_max": time.perf_counter() - t0})
    _send(conn, rb, {"synthetic": True})


def rollout_worker(conn: Any, spec: dict[str, Any], counts: Any) -> None:
    """The rollout process: build, then answer the driver until ``stop``."""
    rollouts = _build(spec, counts)
    conn.send(("ok", os.getpid()))
    ops = {"pause": rollouts.pause, "resume": rollouts.resume, "set_version": rollouts.set_version,
           "stats": rollouts.stats}
    while True:
        op, args = conn.recv()
        if op == "stop":  # no graceful shutdown of thousands of requests: end the reward pools, exit
            from realscale.rollout.rewards import close_reward_pools

            close_reward_pools()
            conn.send(("ok", None))
            os._exit(0)
        try:
            if op in ("next_batch", "hand_synthetic"):
                (_next_batch if op == "next_batch" else _hand_synthetic)(conn, rollouts, *args)
                continue
            conn.send(("ok", ops[op](*args)))
        except Exception as exc:  # noqa: BLE001 - the driver reports it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Worker:
    """The driver's handle on the rollout process."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from realscale.config import load_config

        self.algo = load_config(None, spec["overrides"]).algo  # the driver makes the batch's tensors
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # answers' tokens, answers, interruptions (workflow side); reply tokens, replies (client side)
        self.counts = ctx.Array("d", 5, lock=False)
        self.proc = ctx.Process(target=rollout_worker, args=(child, spec, self.counts), name="rollout-worker")
        self.proc.start()
        child.close()
        self.pid = self._reply()

    def _reply(self) -> Any:
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(payload)
        if kind == "batch":
            return self._batch(payload)
        return payload

    def _batch(self, header: dict[str, Any]) -> Any:
        from realscale.rollout.process import _recv_batch

        return _recv_batch(self.conn, header).packed(self.algo)

    def call(self, op: str, *args: Any) -> Any:
        self.conn.send((op, args))
        return self._reply()

    # the rollout interface (realscale/rollout/sharded.py: Shard)
    def next_batch(self, num_groups: int, version: int, timeout: float | None = None) -> Any:
        return self.call("next_batch", num_groups, version, timeout)

    def pause(self) -> None:
        self.call("pause")

    def resume(self) -> None:
        self.call("resume")

    def set_version(self, version: int) -> None:
        self.call("set_version", version)

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def stop(self) -> None:
        try:
            self.call("stop")
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


class Control:
    """Rank 0's server control: its own client on its own loop (as ServerControl)."""

    def __init__(self, urls: list[str], backend: str) -> None:
        from realscale.inference.client import InferenceClient, dialect_for

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = InferenceClient(urls, dialect=dialect_for(backend))
        self.run(self.client.start())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(600)

    def close(self) -> None:
        self.run(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# ---------------------------------------------------------------------- measuring


def tree_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of process ``pid`` (every thread) and of its descendants."""
    from _cpu_monitor import _children, _proc_cpu

    own = (_proc_cpu(pid) or (0.0, 0.0))[0]
    kids, stack, rest = _children(), list(_children().get(pid, [])), 0.0
    while stack:
        c = stack.pop()
        rest += (_proc_cpu(c) or (0.0, 0.0))[0]
        stack.extend(kids.get(c, []))
    return own, rest


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


class Sampler:
    """Every ``interval`` s: the fleet's counters and the rollout process's CPU."""

    def __init__(self, fleet: FleetProcess, workers: list["Worker"], interval: float = 0.5) -> None:
        self.fleet, self.workers, self.interval = fleet, workers, interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.take()
            self._stop.wait(self.interval)

    def take(self) -> dict[str, float]:
        cpu = [tree_cpu(w.pid) for w in self.workers]
        s = {"t": time.monotonic(), "cpu": sum(c[0] for c in cpu), "cpu_children": sum(c[1] for c in cpu),
             "cpu_each": [c[0] for c in cpu], **self.fleet.stats()}
        for i, key in enumerate(("in_tokens", "in_answers", "in_interruptions", "rx_tokens", "rx_replies")):
            s[key] = sum(w.counts[i] for w in self.workers)
        self.samples.append(s)
        return s

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Deltas between the samples nearest ``t0`` and ``t1``, and the held requests' mean and peak."""
        inside = [s for s in self.samples if t0 <= s["t"] <= t1]
        if len(inside) < 2:
            raise SystemExit("bench_rollout_tier: the window holds fewer than 2 samples")
        a, b = inside[0], inside[-1]
        d = {k: b[k] - a[k] for k in ("t", "cpu", "cpu_children", "tokens", "replies", "finished", "aborted",
                                      "in_tokens", "in_answers", "in_interruptions", "rx_tokens", "rx_replies")}
        d["cpu_each"] = [y - x for x, y in zip(a["cpu_each"], b["cpu_each"])]
        d["held_mean"] = statistics.fmean(s["held"] for s in inside)
        d["held_max_sampled"] = max(s["held"] for s in inside)
        return d


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------- one case


def hold_phase(s: Settings, fleet: FleetProcess, sampler: Sampler, target: int) -> dict[str, Any]:
    """Requests held at the hold rate: wait until the fleet holds ``target`` (or 30 s),
    then measure for ``s.hold_s``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sampler.take()["held"] < target:
        time.sleep(0.2)
    fleet.reset_peak()
    t0 = time.monotonic()
    time.sleep(s.hold_s)
    w = sampler.window(t0, time.monotonic())
    peak = fleet.stats()["peak_held"]
    return {"seconds": w["t"], "held_mean": w["held_mean"], "held_peak": peak,
            "cpu_per_s": w["cpu"] / w["t"], "target": target, "load_avg": _load()}


def update(rollouts: Any, control: Control, s: Settings, version: int) -> dict[str, Any]:
    """One trainer step's end as rank 0 runs it: take a batch if ``s.batch`` groups are
    ready, then pause the rollouts and the servers (abort), load the next version (only
    after a batch: versions move with training), resume. Without a batch the pause still
    interrupts every request, as the step's update would."""
    rec: dict[str, Any] = {"batch": False}
    t0 = time.perf_counter()
    try:
        rb = rollouts.next_batch(s.batch, version, 0.05)
    except RuntimeError as exc:
        if "TimeoutError" not in str(exc):
            raise
    else:
        took = time.perf_counter() - t0
        rec.update(batch=True, next_batch_s=took, wait_s=rb.stats["bench/wait_s_max"],
                   pack_s=rb.stats["bench/pack_s_max"], hand_s=took - rb.stats["bench/wait_s_max"],
                   batch_tokens=rb.batch.num_tokens)
        time.sleep(s.train_s)
    t1 = time.perf_counter()
    rollouts.pause()  # waits for the rollout process's event loop (its request clocks are held there)
    rec["rollouts_pause_s"] = time.perf_counter() - t1
    control.run(control.client.pause("abort"))
    new = version + 1 if rec["batch"] else version
    if rec["batch"]:
        control.run(control.client.update_weights_from_disk("load-fleet", new))
        rollouts.set_version(new)
    control.run(control.client.resume())
    rollouts.resume()
    rec.update(update_s=time.perf_counter() - t1, version=new)
    return rec


def ingest_phase(s: Settings, fleet: FleetProcess, rollouts: Any, control: Control,
                 sampler: Sampler) -> dict[str, Any]:
    """The rate raised to ``s.ingest_rate``; a weight update (with a batch when one is
    ready) every ``s.update_every`` s; measured over the last ``s.seconds`` of
    ``settle_s + seconds``."""
    fleet.set_rate(s.ingest_rate)
    start = time.monotonic()
    t0, t1 = start + s.settle_s, start + s.settle_s + s.seconds
    updates, version, nxt = [], 0, start + s.update_every
    while time.monotonic() < t1:
        time.sleep(max(0.0, min(nxt, t1) - time.monotonic()))
        if time.monotonic() >= t1:
            break
        rec = update(rollouts, control, s, version)
        version = rec["version"]
        rec["ended"] = time.monotonic() - start
        updates.append(rec)
        nxt = time.monotonic() + s.update_every
    w = sampler.window(t0, t1 + 0.6)
    tokens, answers, cpu = w["rx_tokens"], w["in_answers"], w["cpu"]
    return {"window_s": w["t"], "tokens_per_s": tokens / w["t"], "answers_per_s": answers / w["t"],
            "tokens": tokens, "answers": answers, "replies": w["rx_replies"], "answer_tokens": w["in_tokens"],
            "interruptions": w["in_interruptions"],
            "cpu_s": cpu, "cpu_per_s": cpu / w["t"], "cpu_per_s_each": [c / w["t"] for c in w["cpu_each"]],
            "reward_cpu_s": w["cpu_children"],
            "cpu_per_token_us": 1e6 * cpu / max(1.0, tokens), "cpu_per_answer_ms": 1e3 * cpu / max(1.0, answers),
            "reward_cpu_per_answer_ms": 1e3 * w["cpu_children"] / max(1.0, answers),
            "fleet_tokens_per_s": w["tokens"] / w["t"], "fleet_held_mean": w["held_mean"],
            "fleet_aborted_segments": w["aborted"], "updates": updates, "load_avg": _load()}


def hand_phase(s: Settings, workers: list[Worker], lengths: str) -> dict[str, Any]:
    """pack_groups_raw + the pipe (and the driver's tensors) for a batch of ``s.hand_groups``
    synthetic groups of these lengths (each shard its share, at once), while the rollout
    processes go on ingesting."""
    from realscale.rollout.sharded import join_batches, split_evenly

    shares = split_evenly(s.hand_groups, len(workers))
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
        parts = list(pool.map(lambda wn: wn[0].call("hand_synthetic", wn[1], lengths), zip(workers, shares)))
    rb = join_batches(parts)
    total = time.perf_counter() - t0
    return {"groups": s.hand_groups, "tokens": rb.batch.num_tokens, "pack_s": rb.stats["bench/pack_s_max"],
            "hand_s": total, "hand_us_per_token": 1e6 * total / rb.batch.num_tokens}


def run_case(name: str, s: Settings, model: str, tokenizer: Any, workdir: str) -> dict[str, Any]:
    from realscale.rollout.sharded import ShardedRollouts, shard_servers

    client, lengths, k = CASES[name]
    script = fleet_script(tokenizer, s.hold_rate, s.slots, lengths, s.backend)
    fleet = FleetProcess(script, s.servers, s.backend, s.max_new_tokens + 64, workdir)
    control = Control(fleet.urls, s.backend)
    servers = shard_servers(fleet.urls, k)
    workers = [Worker({"overrides": s.overrides(lengths), "model": model, "urls": servers[i], "client": client,
                       "connect_timeout": s.connect_timeout, "shard": (i, k)}) for i in range(k)]
    rollouts = workers[0] if k == 1 else ShardedRollouts(workers, servers, s.batch)
    sampler = Sampler(fleet, workers)
    try:
        rollouts.resume()  # the servers hold version 0: generation may start
        cap = min((s.eta + 1) * s.batch, s.max_concurrent) * s.n_samples
        target = min(cap, 256 * k) if client == "pool256" else min(cap, s.servers * 2 * s.slots)
        hold = hold_phase(s, fleet, sampler, target)
        hold["rss_mb"] = sum(rss_mb(w.pid) for w in workers)
        ingest = ingest_phase(s, fleet, rollouts, control, sampler)
        hand = hand_phase(s, workers, lengths)
        stats = rollouts.stats()
    finally:
        sampler.stop()
        for w in workers:
            w.stop()
        control.close()
        fleet.close()
    print(f"{name}: held {hold['held_mean']:.0f}, {ingest['tokens_per_s']:,.0f} tok/s, "
          f"{ingest['cpu_per_token_us']:.2f} us/token, {len(ingest['updates'])} updates", flush=True)
    return {"client": client, "lengths": lengths, "processes": k, "hold": hold, "ingest": ingest, "hand": hand,
            "controller": {key: stats.get(key) for key in ("version", "submitted", "accepted", "failures",
                                                           "generated_tokens", "capacity", "due_waits")}}


# ---------------------------------------------------------------------- summary


def split_costs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """CPU = per_answer x answers + per_token x tokens, solved over two cases."""
    x1, y1, c1 = a["answers"], a["tokens"], a["cpu_s"]
    x2, y2, c2 = b["answers"], b["tokens"], b["cpu_s"]
    det = x1 * y2 - x2 * y1
    if abs(det) < 1e-9:
        return {}
    per_answer = (c1 * y2 - c2 * y1) / det
    per_token = (x1 * c2 - x2 * c1) / det
    return {"per_answer_s": per_answer, "per_token_s": per_token}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def table(results: dict[str, Any]) -> str:
    rows = ["| case | client | processes | answer lengths | in flight held (mean / peak) | CPU while holding | "
            "tokens/s ingested (CPU) | answers/s | CPU per token | CPU per answer | reward workers per answer | "
            "hand a batch (pack + pipe) | load 1 min (hold / ingest) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        h, i, b = r["hold"], r["ingest"], r["hand"]
        each = " + ".join(f"{c:.2f}" for c in i["cpu_per_s_each"])
        rows.append(f"| {name} | {r['client']} | {r['processes']} | {r['lengths']} | {h['held_mean']:,.0f} / "
                    f"{h['held_peak']:,} | {h['cpu_per_s']:.2f} core | {i['tokens_per_s']:,.0f} ({each} core) | "
                    f"{i['answers_per_s']:.1f} | {i['cpu_per_token_us']:.2f} us | {i['cpu_per_answer_ms']:.1f} ms | "
                    f"{i['reward_cpu_per_answer_ms']:.2f} ms | {b['hand_us_per_token']:.2f} us/token "
                    f"({b['hand_s']:.1f} s for {b['tokens'] / 1e6:.1f}M) | {h['load_avg'][0]} / {i['load_avg'][0]} |")
    return "\n".join(rows)


GPU_GRID = {"1.5b": (32, 64, 128, 256, 512, 1024), "7b": (64, 128, 256, 512, 1024), "32b": (256, 512, 1024)}
HEADROOM = 2.0


def measured_costs(data: dict[str, Any]) -> tuple[float, float, str]:
    """(CPU s per token, per answer, how): the two-case split when it is positive, else the
    lognormal case's CPU per token with nothing per answer."""
    c = data.get("costs") or {}
    if c.get("per_token_s", -1) > 0 and c.get("per_answer_s", -1) >= 0:
        return c["per_token_s"], c["per_answer_s"], "split over per_server and per_server_long_tail"
    i = data["cases"]["per_server"]["ingest"]
    return i["cpu_s"] / i["tokens"], 0.0, "per_server: all its CPU over its tokens"


def _simulate(cal: Any, size: str, gpus: int, ctx: int, rollout: Any) -> Any:
    from realscale.sim import paper as P

    sc = P.scenario(cal, size, gpus, ctx - 1024, "areal")
    sc.rollout = rollout
    return sc.run(steps=10, warmup=3, sample=0.25, seed=0)


def _processes_for_1024(cal: Any, size: str, ctx: int, per_token: float, per_answer: float, how: str,
                        one: dict[str, Any]) -> dict[str, Any]:
    """The fewest rollout processes that leave each at most 1/HEADROOM loaded at 1,024 GPUs
    (a loaded process slows the run, which lowers its own load: so counted up, not divided)."""
    from realscale.sim.des import RolloutModel

    k, r = 1, None
    load = one["rollout_load"]
    while load > 1 / HEADROOM and k < 32:
        k += 1
        r = _simulate(cal, size, 1024, ctx, RolloutModel(per_token, per_answer, k, how))
        load = r.rollout_load
    return {"load_one_process": one["rollout_load"], "processes": k, "load_each": load,
            "tokens_per_s": r.tokens_per_s if r else one["tokens_per_s"], "tokens_per_s_one_process": one["tokens_per_s"]}


def derive(path: str) -> dict[str, Any]:
    """The AReaL workloads (realscale/sim/paper.py: calibrated H800, AReaL's layouts, eta 4,
    512 x 16 answers) with the measured rollout cost: the busiest rollout process's load
    at each size, context and GPU count; the largest cluster one process feeds with
    ``HEADROOM``x; at 1,024 GPUs the processes that give it."""
    from realscale.sim import paper as P
    from realscale.sim.des import RolloutModel

    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    per_token, per_answer, how = measured_costs(data)
    with open(os.path.join(REPO, "benchmarks", "results", "sim_calibration.json"), encoding="utf-8") as fh:
        cal = P.Calibrated.from_dict(json.load(fh))
    one = RolloutModel(per_token, per_answer, 1, how)
    rows, largest, at_1024 = [], {}, {}
    for size, grid in GPU_GRID.items():
        for ctx in (16384, 32768):
            key = f"{size}/{ctx // 1024}k"
            fed = []
            for g in grid:
                r = _simulate(cal, size, g, ctx, one)
                rows.append({"size": size, "context": ctx, "gpus": g, "tokens_per_s": r.tokens_per_s,
                             "generated_tokens_per_s": r.generated_tokens_per_s, "rollout_load": r.rollout_load})
                if r.rollout_load <= 1 / HEADROOM:
                    fed.append(g)
                print(f"{key} {g:>5} GPUs: load {r.rollout_load:.2f} of one rollout process", flush=True)
            largest[key] = max(fed) if fed else 0
            at_1024[key] = _processes_for_1024(cal, size, ctx, per_token, per_answer, how, rows[-1])
    out = {"per_token_s": per_token, "per_answer_s": per_answer, "costs_from": how, "headroom": HEADROOM,
           "command": "python benchmarks/bench_rollout_tier.py derive", "rows": rows,
           "largest_cluster_one_process": largest, "at_1024_gpus": at_1024}
    data["derived"] = out
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
    for key, v in at_1024.items():
        print(f"{key}: one process feeds up to {largest[key]} GPUs with {HEADROOM:g}x headroom; at 1,024 GPUs "
              f"load {v['load_one_process']:.2f} -> {v['processes']} process(es), load {v['load_each']:.2f} each; "
              f"{v['tokens_per_s_one_process']:,.0f} -> {v['tokens_per_s']:,.0f} trained tokens/s")
    return out


def main() -> int:
    if sys.argv[1:2] == ["derive"]:
        derive(sys.argv[2] if len(sys.argv) > 2 else RESULT)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--servers", type=int, default=36)
    ap.add_argument("--slots", type=int, default=256, help="generate.max_running_requests per server")
    ap.add_argument("--batch", type=int, default=64, help="prompts per step (the recipes: 512)")
    ap.add_argument("--n-samples", type=int, default=16)
    ap.add_argument("--eta", type=int, default=8)
    ap.add_argument("--max-concurrent", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=27648)
    ap.add_argument("--reward-workers", type=int, default=1)
    ap.add_argument("--hold-rate", type=float, default=25.0, help="tokens/s per request in the hold phase")
    ap.add_argument("--ingest-rate", type=float, default=400.0, help="tokens/s per request in the ingest phase")
    ap.add_argument("--hold-s", type=float, default=4.0)
    ap.add_argument("--update-every", type=float, default=30.0,
                    help="seconds between weight updates in the ingest phase (about twice an answer's time, as a "
                         "cluster's step is against its answers)")
    ap.add_argument("--settle-s", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=25.0, help="the ingest window")
    ap.add_argument("--train-s", type=float, default=2.0, help="the trainer's update (sleep)")
    ap.add_argument("--backend", choices=("sglang", "vllm"), default="sglang")
    ap.add_argument("--connect-timeout", type=float, default=60.0,
                    help="the client's connect timeout (today's default is 5 s: see BENCHMARKS.md)")
    ap.add_argument("--hand-groups", type=int, default=16, help="groups in the synthetic batch handed over")
    ap.add_argument("--out", default=RESULT)
    args = ap.parse_args()
    s = Settings(args.servers, args.slots, args.batch, args.n_samples, args.eta, args.max_concurrent,
                 args.max_new_tokens, args.reward_workers, args.hold_rate, args.ingest_rate, args.hold_s,
                 args.update_every, args.settle_s, args.seconds, args.train_s, args.backend, args.connect_timeout,
                 args.hand_groups)

    from transformers import AutoTokenizer

    from realscale.models.tiny import resolve_model_path

    model = resolve_model_path("small-qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    load_before = _load()
    started = time.time()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.cases:
            results[name] = run_case(name, s, model, tokenizer, workdir)
    out: dict[str, Any] = {"benchmark": "rollout_tier", "command": "python " + " ".join(
        [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]), "settings": vars(args), "cases": results,
        "tokenizer": "small-qwen2 (byte-level: one token per character)", "machine_cores": os.cpu_count(),
        "load_avg_before": load_before, "load_avg_after": _load(), "seconds": round(time.time() - started),
        "date": time.strftime("%Y-%m-%d %H:%M")}
    if "per_server" in results and "per_server_long_tail" in results:
        out["costs"] = split_costs(results["per_server"]["ingest"], results["per_server_long_tail"]["ingest"])
    print(table(results))
    if out.get("costs"):
        c = out["costs"]
        print(f"CPU per answer {c['per_answer_s'] * 1e3:.2f} ms + per token {c['per_token_s'] * 1e6:.3f} us")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    print(f"wrote {os.path.relpath(args.out, REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

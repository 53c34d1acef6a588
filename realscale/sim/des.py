"""Discrete-event simulation of a whole RL run: generation servers, controller, trainer.

What is simulated, event by event (times in seconds):

- **Generation servers** with continuous batching, as SGLang and the embedded server run:
  each iteration admits waiting requests into free slots (prefill), then runs one batched
  decode step for every running request; a request leaves when its answer is complete.
  Decode step time comes from :class:`ServerModel` (the planner's cost model, or a CPU
  profile fitted to measured steps) as a function of the batch size and the mean context
  (paged attention: SGLang, vLLM), or the longest context in the batch for a server whose
  attention runs over the batch padded to its longest row (``padded``: realscale's
  embedded server, ``realscale/serve/decoder.py``).
  A server with a KV-cache budget admits only what fits and retracts its newest request
  when the running ones outgrow it (SGLang's behaviour).
  Between events a server advances many steps at once: with the batch fixed, the step
  count until the next answer finishes is known, and the steps' summed time is the step
  time at the chunk's mean context times the count (exact for the cost model's step time,
  which is linear in the context on either side of its max()).
- **The rollout controller**: submits prompts (``n_samples`` requests each, to the least
  loaded server) while :meth:`realscale.rollout.staleness.StalenessManager.capacity` allows
  (the same object the real controller uses, not a copy of its rule), pauses submission
  during weight updates, hands the trainer the ``batch`` accepted groups submitted first,
  and waits while a *due* group (submitted at version <= V - η) is still generating,
  exactly as :class:`realscale.rollout.controller.RolloutController` does. η = 0 is the
  synchronous run.
- **The trainer**: takes a batch, trains (:class:`TrainerModel`: the planner's cost model
  for its layout), then updates the servers' weights: pause (interrupting generation),
  move the weights (:attr:`TrainerModel.sync_seconds`), bump the version, resume. With
  ``interrupt="recompute"`` an interrupted request's KV cache is recomputed under the new
  weights when it resumes (AReaL's interruptible rollout: a prefill of prompt + partial
  answer), and each request in a server when it pauses is aborted and answered with its
  partial output, which costs the pause :attr:`TrainerModel.abort_seconds` per request
  (the server's and the client's per-request cost; 0 on GPUs); ``"in_place"`` keeps them
  (SGLang's in-place pause, the embedded server's ``pause_mode: in_place``).
- **Colocated** runs (verl, ReaL): the same GPUs generate and train in turn; only η = 0 is
  meaningful there, and the step adds the cost of switching (``switch_seconds``).
- **A shared host** (``host_cores`` > 0: a CPU machine, where every role runs on the same
  few cores): processor sharing. Each decoding server demands one core, plus the host CPU
  its requests cost outside it (``client_cpu_per_request``: controller, workflow, reward
  workers; requests per second taken as its tokens per second over the mean answer
  length); the trainer demands one core while it trains. With demand ``D`` above the
  ``C`` cores every role runs at ``C / D`` of its speed. A server's speed is set when it
  plans a chunk (the trainer starting cuts every chunk at its next step); the trainer's
  is set again whenever a server starts or ends a chunk (its compute so far counted at
  the old speed), so a step that overlaps generation for part of its length is slowed for
  that part only. After a weight update the servers get their new prompts before the
  trainer takes its next batch, as the real controller resumes while the trainer goes on. On GPUs ``host_cores`` is 0 and nothing is shared.

- **The rollout processes** (:class:`RolloutModel`, on GPUs): every answer a server
  finishes is ingested by the rollout process that owns its server (server ``i`` ->
  process ``i mod k``: :mod:`realscale.rollout.sharded`) at ``per_answer_s + per_token_s
  x length`` CPU seconds, one answer at a time: the answer reaches the controller (its
  group, the batch, the next prompt) only when its process has taken it in. A process
  loaded past 1 queues answers and slows the run; ``SimResult.rollout_load`` is the busiest
  process's busy fraction (below 0.5: at least 2x headroom). The costs are measured
  (``benchmarks/bench_rollout_tier.py``); a CPU machine's host sharing is modelled by
  ``host_cores`` instead, so there the rollout model is off.

Outputs (:class:`SimResult`): effective training throughput (trained answer tokens / wall
time, the AReaL paper's metric and ``perf/trained_tokens_per_s`` of our runs), generated
tokens/s, idle fractions per role (the fraction of the role's GPU-time with nothing to do:
a server with no running request or paused; the trainer waiting for a batch), weight-sync
seconds, and the timeline of every step.

Departures from the real system: answers are independent draws unless the workload
draws a group together (:class:`realscale.sim.workload.TaskMix`); the weight transfer
starts when the trainer finishes, not when the last server has finished its current step;
rewards, batch packing and HTTP take no time beyond the profile's per-request overhead on a
CPU host, and beyond the rollout model's per-answer and per-token CPU on GPUs (which does
not model the rollout process's pauses, nor the batch's packing apart).
"""

from __future__ import annotations

import collections
import heapq
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from realscale.rollout.staleness import StalenessManager
from realscale.sim.workload import Workload
from realscale.errors import UserError

# event kinds
_CHUNK, _TRAIN_DONE, _SYNC_DONE, _INGESTED = 0, 1, 2, 3


class SimError(UserError):
    """An impossible simulation setup (a layout that cannot hold one request, ...)."""


@dataclass
class ServerModel:
    """One generation server (a tp group): step times and capacity."""

    decode_step: Callable[[int, float], float]  # (running requests, mean context tokens) -> s
    prefill: Callable[[int, int], float]         # (prompt + recomputed tokens, admitted requests) -> s
    max_running: int = 1 << 30                   # slots (max_running_requests)
    kv_tokens: float = math.inf                  # tokens the KV cache holds
    reserve_ratio: float = 0.1                   # share of remaining budgets held back on admission
    gpus: int = 1                                # GPUs per server (its tp)
    padded: bool = False                         # attention over the batch padded to its longest context


@dataclass
class TrainerModel:
    """The training side: step time for a batch, and the weight update."""

    train_seconds: Callable[[int, int, int], float]  # (sequences, prompt tokens, answer tokens) -> s
    sync_seconds: float                              # pause + move weights + resume
    gpus: int = 1
    abort_seconds: float = 0.0                       # per request aborted by a pause (interrupt="recompute")


@dataclass(frozen=True)
class RolloutModel:
    """The rollout side: ``processes`` rollout processes, each spending ``per_answer_s +
    per_token_s x length`` CPU seconds on an answer (client, workflow, reward dispatch,
    packing), one core each."""

    per_token_s: float = 0.0
    per_answer_s: float = 0.0
    processes: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        if self.per_token_s < 0 or self.per_answer_s < 0 or self.processes < 1:
            raise SimError(f"sim: rollout costs must be >= 0 and processes >= 1, got {self}")

    @property
    def active(self) -> bool:
        return self.per_token_s > 0 or self.per_answer_s > 0

    def seconds(self, tokens: int) -> float:
        return self.per_answer_s + self.per_token_s * tokens

    def tokens_per_s(self, mean_len: float) -> float:
        """Generated tokens per second the processes take in at answers of ``mean_len`` tokens."""
        return self.processes * mean_len / self.seconds(mean_len) if self.active else math.inf


@dataclass
class SimConfig:
    workload: Workload
    eta: int                          # staleness bound (0: synchronous)
    n_servers: int
    max_concurrent: int = 1 << 30     # most prompts in flight (rollout.max_concurrent)
    steps: int = 10                   # RL steps to simulate
    warmup: int = 2                   # steps left out of the throughput (pipeline fill)
    interrupt: str = "in_place"       # in_place | recompute
    colocated: bool = False           # servers and trainer share GPUs (synchronous only)
    switch_seconds: float = 0.0       # colocated: per-step cost of switching roles
    seed: int = 0
    host_cores: float = 0.0           # > 0: every role shares these cores (module docstring)
    client_cpu_per_request: float = 0.0  # host CPU seconds per request outside the servers
    rollout: RolloutModel = RolloutModel()  # the rollout processes' ingest (off by default)

    def __post_init__(self) -> None:
        if self.eta < 0 or self.n_servers < 1 or self.steps < 1 or not 0 <= self.warmup < self.steps:
            raise SimError(f"sim: need eta >= 0, n_servers >= 1, 0 <= warmup < steps; got {self.eta}, "
                           f"{self.n_servers}, {self.warmup}, {self.steps}")
        if self.interrupt not in ("in_place", "recompute"):
            raise SimError(f"sim: interrupt {self.interrupt!r} is not in_place or recompute")
        if self.colocated and self.eta:
            raise SimError("sim: colocated runs alternate generation and training; eta must be 0")
        if self.host_cores < 0 or self.client_cpu_per_request < 0:
            raise SimError(f"sim: need host_cores >= 0 and client_cpu_per_request >= 0, got {self.host_cores}, "
                           f"{self.client_cpu_per_request}")


@dataclass
class StepRecord:
    step: int
    batch_ready: float      # the trainer got its batch
    train_end: float
    sync_end: float
    wait_s: float           # since the previous step ended
    trained_tokens: int
    max_staleness: int


@dataclass
class SimResult:
    tokens_per_s: float                 # effective training throughput over the measured steps
    generated_tokens_per_s: float
    step_seconds: float                 # mean over the measured steps
    idle: dict[str, float]              # role -> idle fraction of its GPU-time
    weight_sync_s: float                # per step
    timeline: list[StepRecord]
    window: tuple[float, float]
    accepted_fraction: float
    mean_trained_len: float
    mean_generated_len: float
    staleness_hist: dict[int, int]
    rollout_load: float = 0.0           # busiest rollout process's busy fraction (0: not modelled)

    def summary(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "generated_tokens_per_s": self.generated_tokens_per_s,
                "step_seconds": self.step_seconds, "idle": self.idle, "weight_sync_s": self.weight_sync_s,
                "accepted_fraction": self.accepted_fraction, "mean_trained_len": self.mean_trained_len,
                "mean_generated_len": self.mean_generated_len, "rollout_load": self.rollout_load,
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())}}


class _Seq:
    __slots__ = ("uid", "group", "length", "base", "admit_step", "recompute")
    _next = 0

    def __init__(self, group: "_Group", length: int) -> None:
        _Seq._next += 1
        self.uid = _Seq._next  # heap entries name requests by it (id() may be reused)
        self.group = group
        self.length = length
        self.base = 0          # tokens generated before its current admission
        self.admit_step = 0
        self.recompute = True  # its prompt (+ partial answer) must be prefilled on admission


class _Group:
    __slots__ = ("order", "version", "seqs", "left", "steps", "prompt")

    def __init__(self, order: int, version: int, lengths: np.ndarray, steps: np.ndarray, prompt: int) -> None:
        self.order = order
        self.version = version
        self.seqs = [_Seq(self, int(n)) for n in lengths]
        self.left = len(self.seqs)
        self.steps = steps
        self.prompt = prompt


class _Server:
    __slots__ = ("idx", "running", "heap", "waiting", "step", "ctx_sum", "token", "active", "t_start", "t0",
                 "st", "k", "boundary", "paused", "busy", "demand")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.running: dict[int, _Seq] = {}
        self.heap: list[tuple[int, int]] = []   # (finish step, seq.uid)
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.step = 0           # decode steps run so far
        self.ctx_sum = 0        # total context of running requests
        self.token = 0          # invalidates superseded chunk events
        self.active = False
        self.t_start = 0.0      # chunk start (prefill start)
        self.t0 = 0.0           # first decode step of the chunk
        self.st = 0.0           # step time in this chunk
        self.k = 0              # steps this chunk runs
        self.boundary = False   # the chunk was cut short at a step boundary
        self.paused = False
        self.busy = 0.0
        self.demand = 0.0       # cores of a shared host its current chunk demands


class Simulation:
    """One run; :meth:`run` returns its :class:`SimResult`."""

    def __init__(self, cfg: SimConfig, server: ServerModel, trainer: TrainerModel) -> None:
        self.cfg, self.sm, self.tm = cfg, server, trainer
        w = cfg.workload
        self.rng = np.random.default_rng(cfg.seed)
        self.mgr = StalenessManager(w.batch, cfg.eta, cfg.max_concurrent)
        self.servers = [_Server(i) for i in range(cfg.n_servers)]
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq_no = 0
        self.version = 0
        self.order = 0
        self.buffer: list[tuple[int, int, _Group]] = []  # heap by (submit version, order)
        self.running_versions: collections.Counter[int] = collections.Counter()
        self.submitting = True
        self.trainer_busy = False
        self.train_busy = 0.0
        self.sync_busy = 0.0
        self.sync_count = 0
        self.last_step_end = 0.0
        self.timeline: list[StepRecord] = []
        self.submitted = self.accepted = 0
        self.gen_tokens_done = 0
        self.finished = self.finished_len = 0
        self.loads = np.zeros(cfg.n_servers, np.int64)  # requests per server (the client's least-load routing)
        if server.kv_tokens < w.prompt_len + w.max_new_tokens:
            raise SimError(f"sim: one request ({w.prompt_len} + {w.max_new_tokens} tokens) does not fit a server's "
                           f"KV cache of {server.kv_tokens:.0f} tokens")
        self.mean_len = max(1.0, w.mean_length())
        self.training = False   # the trainer computes (not waiting, not syncing)
        self.train_left = 0.0   # the step's compute left, in seconds at full speed
        self.train_rate = 1.0   # its current speed on a shared host
        self.train_t = 0.0      # when train_left was last brought up to date
        self.train_token = 0    # invalidates superseded train-done events
        self.trained_lens: list[int] = []
        self.stale: collections.Counter[int] = collections.Counter()
        self.snap: dict[str, float] = {}
        self.now = 0.0
        rp = cfg.rollout.processes
        self.ingest_free = [0.0] * rp     # when each rollout process has taken in what it was given
        self.ingest_busy = [0.0] * rp
        self.ingesting: dict[int, _Seq] = {}

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq_no += 1
        heapq.heappush(self.events, (t, self.seq_no, kind, a, b))

    def run(self) -> SimResult:
        self._refill()
        while self.events and len(self.timeline) < self.cfg.steps:
            t, _, kind, a, b = heapq.heappop(self.events)
            self.now = t
            if kind == _CHUNK:
                srv = self.servers[a]
                if b == srv.token:
                    self._chunk_done(srv)
            elif kind == _TRAIN_DONE:
                if a == self.train_token:
                    self._train_done()
            elif kind == _INGESTED:
                self._seq_done(self.ingesting.pop(a))
            else:
                self._sync_done()
        if len(self.timeline) < self.cfg.steps:
            raise SimError("sim: the run stalled (no events left before the last step)")
        return self._result()

    # ------------------------------------------------------------------ servers

    def _reserved(self, srv: _Server, extra_ctx: int = 0, extra_seqs: int = 0) -> float:
        """KV tokens the running requests (plus ``extra``) hold now and are expected to
        need: SGLang admits a request only if current tokens plus ``reserve_ratio`` of every
        request's remaining budget fit (its ``new_token_ratio``)."""
        r = self.sm.reserve_ratio
        b = len(srv.running) + extra_seqs
        full = self.cfg.workload.prompt_len + self.cfg.workload.max_new_tokens
        return (1 - r) * (srv.ctx_sum + extra_ctx) + r * b * full

    def _admit(self, srv: _Server) -> int:
        """Move waiting requests into slots that fit; return tokens to prefill."""
        tokens = 0
        while srv.waiting and len(srv.running) < self.sm.max_running:
            seq = srv.waiting[0]
            ctx = seq.group.prompt + seq.base
            if srv.running and self._reserved(srv, ctx, 1) > self.sm.kv_tokens:
                break
            srv.waiting.popleft()
            seq.admit_step = srv.step
            srv.running[seq.uid] = seq
            heapq.heappush(srv.heap, (srv.step + seq.length - seq.base, seq.uid))
            srv.ctx_sum += ctx
            if seq.recompute:
                tokens += ctx
                seq.recompute = False
        return tokens

    def _retract_newest(self, srv: _Server) -> None:
        """The KV cache is full: the newest request goes back to the queue (keeping its output)."""
        seq = srv.running[next(reversed(srv.running))]  # dicts keep admission order
        self._unrun(srv, seq)
        seq.recompute = True
        srv.waiting.appendleft(seq)

    def _unrun(self, srv: _Server, seq: _Seq) -> None:
        del srv.running[seq.uid]  # its heap entry is dropped lazily (_top)
        done = seq.base + srv.step - seq.admit_step
        srv.ctx_sum -= seq.group.prompt + done
        seq.base = done

    def _plan(self, srv: _Server, extra_prefill: int = 0) -> None:
        """Start the server's next chunk of decode steps at ``self.now``."""
        srv.active = False
        if srv.paused:
            return
        before = len(srv.running)
        prefill_tokens = self._admit(srv) + extra_prefill
        admitted = len(srv.running) - before
        while srv.running:
            b = len(srv.running)
            k = self._top(srv) - srv.step
            if math.isfinite(self.sm.kv_tokens):
                room = int((self.sm.kv_tokens - srv.ctx_sum) // b)
                if room < 1 and b > 1:
                    self._retract_newest(srv)
                    continue
                k = max(1, min(k, room))
            srv.k = max(1, k)
            st = self.sm.decode_step(b, self._context(srv) + srv.k / 2)
            srv.demand = 1.0 + self.cfg.client_cpu_per_request * b / (st * self.mean_len)
            speed = self._speed(srv.demand)
            srv.st = st / speed
            srv.t_start = self.now
            pre = self.sm.prefill(prefill_tokens, admitted) / speed if prefill_tokens or admitted else 0.0
            srv.t0 = self.now + pre
            srv.token += 1
            srv.active, srv.boundary = True, False
            self._push(srv.t0 + srv.k * srv.st, _CHUNK, srv.idx, srv.token)
            self._rate_trainer()
            return
        self._rate_trainer()

    def _context(self, srv: _Server) -> float:
        """The context a decode step of ``srv`` attends over now: the running requests'
        mean, or their longest for a padded server."""
        if not self.sm.padded:
            return srv.ctx_sum / len(srv.running)
        return float(max(s.group.prompt + s.base + srv.step - s.admit_step for s in srv.running.values()))

    def _speed(self, own: float = 0.0, trainer: bool = False) -> float:
        """The share of its speed every role gets on a shared host: cores over demand, with
        the active servers, the trainer if it trains, and ``own`` (the role asking)."""
        cores = self.cfg.host_cores
        if cores <= 0:
            return 1.0
        demand = own + sum(s.demand for s in self.servers if s.active) + (1.0 if self.training or trainer else 0.0)
        return min(1.0, cores / demand) if demand > 0 else 1.0

    def _top(self, srv: _Server) -> int:
        """The step at which the first running request finishes (stale heap entries dropped)."""
        while True:
            f, sid = srv.heap[0]
            seq = srv.running.get(sid)
            if seq is not None and seq.admit_step + seq.length - seq.base == f:
                return f
            heapq.heappop(srv.heap)

    def _cut(self, srv: _Server) -> None:
        """Something changed (new requests, a pause): end the chunk at the next step boundary."""
        if not srv.active or srv.boundary:
            return
        if self.now <= srv.t0:
            j = 0
            t = srv.t0
        else:
            j = min(srv.k, math.ceil((self.now - srv.t0) / srv.st - 1e-12))
            t = srv.t0 + j * srv.st
        if j >= srv.k:
            return
        srv.k, srv.boundary = j, True
        srv.token += 1
        self._push(t, _CHUNK, srv.idx, srv.token)

    def _chunk_done(self, srv: _Server) -> None:
        b = len(srv.running)
        srv.busy += self.now - srv.t_start
        srv.step += srv.k
        srv.ctx_sum += b * srv.k
        self.gen_tokens_done += b * srv.k
        finished = []
        while srv.running and self._top(srv) <= srv.step:
            _, sid = heapq.heappop(srv.heap)
            seq = srv.running.pop(sid)
            srv.ctx_sum -= seq.group.prompt + seq.length
            finished.append(seq)
        self.loads[srv.idx] -= len(finished)
        self.finished += len(finished)
        self.finished_len += sum(seq.length for seq in finished)
        srv.active = False
        for seq in finished:
            if self.cfg.rollout.active:
                self._ingest(srv, seq)
            else:
                self._seq_done(seq)
        if not srv.active:  # _seq_done may already have re-planned it (new requests)
            self._plan(srv)

    def _ingest(self, srv: _Server, seq: _Seq) -> None:
        """The answer goes to its server's rollout process, which takes answers one at a time."""
        p = srv.idx % self.cfg.rollout.processes
        cost = self.cfg.rollout.seconds(seq.length)
        self.ingest_free[p] = max(self.now, self.ingest_free[p]) + cost
        self.ingest_busy[p] += cost
        self.ingesting[seq.uid] = seq
        self._push(self.ingest_free[p], _INGESTED, seq.uid)

    # ------------------------------------------------------------------ controller

    def _refill(self) -> None:
        if not self.submitting:
            return
        w = self.cfg.workload
        touched = set()
        for _ in range(self.mgr.capacity(self.version)):
            lengths, steps = w.draw_group(self.rng)
            g = _Group(self.order, self.version, lengths, steps, w.prompt_len)
            self.order += 1
            self.mgr.on_submit()
            self.submitted += 1
            self.running_versions[self.version] += 1
            for seq in g.seqs:
                i = int(np.argmin(self.loads))
                self.loads[i] += 1
                self.servers[i].waiting.append(seq)
                touched.add(i)
        for i in touched:
            srv = self.servers[i]
            if srv.active:
                self._cut(srv)
            elif not srv.paused:
                self._plan(srv)

    def _seq_done(self, seq: _Seq) -> None:
        g = seq.group
        g.left -= 1
        if g.left:
            return
        self.running_versions[g.version] -= 1
        if self.cfg.workload.accept.accept(self.rng, g.steps):
            self.mgr.on_accept()
            self.accepted += 1
            heapq.heappush(self.buffer, (g.version, g.order, g))
        else:
            self.mgr.on_reject()
        self._try_train()
        self._refill()

    def _due_running(self) -> bool:
        return self.mgr.due(self.running_versions, self.version) > 0

    # ------------------------------------------------------------------ trainer

    def _try_train(self) -> None:
        B = self.cfg.workload.batch
        if self.trainer_busy or len(self.buffer) < B or self._due_running() or len(self.timeline) >= self.cfg.steps:
            return
        groups = [heapq.heappop(self.buffer)[2] for _ in range(B)]
        answer_tokens = sum(s.length for g in groups for s in g.seqs)
        n = sum(len(g.seqs) for g in groups)
        for g in groups:
            self.stale[self.version - g.version] += 1
            self.trained_lens.extend(s.length for s in g.seqs)
        t_train = self.tm.train_seconds(n, n * self.cfg.workload.prompt_len, answer_tokens)
        if self.cfg.colocated:
            t_train += self.cfg.switch_seconds
        self.trainer_busy = True
        self._batch = (self.now, answer_tokens, max(self.version - g.version for g in groups))
        self.train_left, self.train_t = t_train, self.now
        if self.cfg.host_cores > 0:
            self.training = True
            for srv in self.servers:  # they now share the host with the trainer
                self._cut(srv)
        self._rate_trainer(start=True)

    def _rate_trainer(self, start: bool = False) -> None:
        """(Re)schedule the end of the trainer's step at its speed now: on a shared host the
        speed changes whenever a server starts or ends a chunk, so the compute left is
        brought up to date at the old speed and the rest runs at the new one."""
        if not (start or self.training):
            return
        self.train_left = max(0.0, self.train_left - (self.now - self.train_t) * self.train_rate)
        self.train_t = self.now
        self.train_rate = self._speed(trainer=True)
        self.train_token += 1
        self._push(self.now + self.train_left / self.train_rate, _TRAIN_DONE, self.train_token)

    def _train_done(self) -> None:
        self.train_busy += self.now - self._batch[0]
        self.training = False
        self.submitting = False
        self._train_end = self.now
        for srv in self.servers:
            srv.paused = True
            self._cut(srv)
        t_sync = self.tm.sync_seconds
        if self.cfg.interrupt == "recompute":  # every request in a server is aborted and answered
            t_sync += self.tm.abort_seconds * sum(len(s.running) + len(s.waiting) for s in self.servers)
        self.sync_busy += t_sync
        self.sync_count += 1
        self._push(self.now + t_sync, _SYNC_DONE)

    def _sync_done(self) -> None:
        ready, tokens, lag = self._batch
        self.timeline.append(StepRecord(len(self.timeline) + 1, ready, self._train_end, self.now,
                                        ready - self.last_step_end, tokens, lag))
        self.last_step_end = self.now
        if len(self.timeline) == self.cfg.warmup:
            self._snapshot()
        self.version += 1
        self.trainer_busy = False
        self.submitting = True
        for srv in self.servers:
            srv.paused = False
            extra = 0
            if self.cfg.interrupt == "recompute" and srv.running:
                # the KV cache was built by the old weights: recompute prompt + partial answers
                extra = srv.ctx_sum
            if not srv.active:
                self._plan(srv, extra)
        self._refill()
        self._try_train()

    # ------------------------------------------------------------------ results

    def _snapshot(self) -> None:
        self.snap = {"t": self.now, "gen_busy": sum(s.busy for s in self.servers),
                     "gen_tokens": float(self.gen_tokens_done), "train_busy": self.train_busy,
                     "sync_busy": self.sync_busy, "sync_count": self.sync_count,
                     "ingest_busy": list(self.ingest_busy)}

    def _result(self) -> SimResult:
        snap = self.snap or {"t": 0.0, "gen_busy": 0.0, "gen_tokens": 0.0, "train_busy": 0.0, "sync_busy": 0.0,
                             "sync_count": 0, "ingest_busy": [0.0] * len(self.ingest_busy)}
        t0, t1 = snap["t"], self.timeline[-1].sync_end
        wall = max(t1 - t0, 1e-12)
        measured = self.timeline[self.cfg.warmup:]
        tokens = sum(r.trained_tokens for r in measured)
        gen_busy = (sum(s.busy for s in self.servers) - snap["gen_busy"]) / (len(self.servers) * wall)
        train_busy = (self.train_busy - snap["train_busy"]) / wall
        sync_busy = (self.sync_busy - snap["sync_busy"]) / wall
        if self.cfg.colocated:  # the same GPUs: idle when neither generating, training nor syncing
            idle = {"all": max(0.0, 1.0 - gen_busy - train_busy - sync_busy)}
        else:
            idle = {"generate": max(0.0, 1.0 - gen_busy), "train": max(0.0, 1.0 - train_busy - sync_busy)}
        return SimResult(
            tokens_per_s=tokens / wall,
            generated_tokens_per_s=(self.gen_tokens_done - snap["gen_tokens"]) / wall,
            step_seconds=wall / len(measured), idle=idle,
            weight_sync_s=(self.sync_busy - snap["sync_busy"]) / max(1, self.sync_count - snap["sync_count"]),
            timeline=self.timeline, window=(t0, t1),
            accepted_fraction=self.accepted / max(1, self.submitted),
            mean_trained_len=float(np.mean(self.trained_lens)) if self.trained_lens else 0.0,
            mean_generated_len=self.finished_len / max(1, self.finished),
            staleness_hist=dict(self.stale),
            rollout_load=max(b - a for a, b in zip(snap["ingest_busy"], self.ingest_busy)) / wall)


def simulate(cfg: SimConfig, server: ServerModel, trainer: TrainerModel) -> SimResult:
    """Run the simulation of ``cfg`` with these server and trainer models."""
    return Simulation(cfg, server, trainer).run()

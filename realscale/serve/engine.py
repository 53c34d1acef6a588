"""The embedded generation engine: continuous batching in a scheduler thread.

Each scheduler iteration (1) runs control commands (pause, continue, abort, weight
swaps) between forward passes, (2) prefills newly arrived requests into free KV slots,
(3) runs ONE batched decode step for every running request, (4) lets finished requests
leave. With the slots full, waiting requests are admitted in batches (a quarter of the
slots at a time, :meth:`Engine._admit_now`), and a group's identical prompts share one
prefill row (:meth:`Engine._prefill`). A long answer therefore never holds up short ones,
and a pause takes effect within one forward pass.

Pause modes follow SGLang's ``/pause_generation``:

- ``abort``: every running and waiting request finishes now with
  ``finish_reason = {"type": "abort"}`` and its partial tokens and log-probs.
- ``retract``: running requests go back to the waiting queue keeping their output; on
  continue they are prefilled again (prompt + output) under whatever weights are loaded
  then, and carry on. The client sees one uninterrupted request.
- ``in_place``: nothing moves; the KV cache is kept (stale if the weights change).

Every output token records the weight version that produced it; responses carry SGLang's
``meta_info["weight_versions"]`` spans (``[{"version", "start", "end"}]``).

The forward passes go through a :class:`~realscale.serve.ranks.ServerRanks` (one rank or
several, tensor-parallel; the engine does not know which): ``forward`` for prefill and
decode, ``move_slot`` when a request leaves, ``call_all`` for anything every rank must
run between forward passes (weight updates; see :meth:`Engine.call`). If the ranks fail,
:meth:`Engine.fail` stops the scheduler and answers every request with an abort.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import torch

from realscale.algo.sampling import sample
from realscale.config import PAUSE_MODES

if TYPE_CHECKING:
    from realscale.data.tokens import Tokenizer
    from realscale.serve.ranks import ServerRanks

log = logging.getLogger(__name__)

# With the queue full, new requests are prefilled once a 1/ADMIT_FRACTION of the slots is
# free (Engine._admit_now).
ADMIT_FRACTION = 4


def running_abort(message: str | None = None, status_code: int | None = None) -> dict[str, Any]:
    """SGLang's finish reason of an aborted running request (``FINISH_ABORT.to_json``)."""
    return {"type": "abort", "message": message or "Aborted", "status_code": status_code, "err_type": None}


def waiting_abort() -> dict[str, Any]:
    """SGLang's finish reason of a request aborted in the waiting queue, before it ran."""
    return {"type": "abort", "message": "Abort in waiting queue"}


@dataclasses.dataclass
class SamplingOptions:
    """The sampling parameters the engine honours (SGLang names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclasses.dataclass
class Request:
    """One generation request and everything it has produced so far."""

    rid: str
    input_ids: list[int]
    params: SamplingOptions
    return_logprob: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # per fed position, the experts each layer routed it to ([layers, top_k] int32); append
    # only: a retracted request prefilled again keeps the routing its tokens were sampled under
    routing: list[torch.Tensor] = dataclasses.field(default_factory=list)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[str] = dataclasses.field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    num_retractions: int = 0
    created: float = dataclasses.field(default_factory=time.monotonic)
    future: Future = dataclasses.field(default_factory=Future)
    text_tail: str = ""  # decoded tail used for stop-string matching

    @property
    def cached_len(self) -> int:
        """Tokens whose K/V are in the cache once prefilled: all but the last output token."""
        return len(self.input_ids) + max(0, len(self.output_ids) - 1)


class Engine:
    """Owns the request queues, the KV slot assignment and the scheduler thread; the
    ranks (``runner``, with ``max_running`` KV slots of ``context_length``) do the math."""

    def __init__(self, runner: "ServerRanks", tokenizer: Tokenizer, *, max_running: int = 32, context_length: int = 2048,
                 weight_version: str = "0", seed: int = 0, eos_token_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.max_running = max_running
        self.admit_batch = max(1, max_running // ADMIT_FRACTION)  # 1: admit whenever a slot is free
        self.share_prefill = True  # False: every request its own prefill row (benchmarks compare)
        self.weight_version = weight_version
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.eos_token_ids = set(eos_token_ids or [])
        self.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # running[i] owns KV slot i
        self.paused: str | None = None  # the pause mode while paused
        self._commands: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._wake = threading.Condition()
        self._stop = False
        self.failure: str | None = None
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="realscale-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public, thread-safe

    def submit(self, req: Request) -> Future:
        """Queue ``req``; its future resolves to the finished :class:`Request`."""
        with self._wake:
            if self.failure is None and not self._stop:
                self.waiting.append(req)
                self._wake.notify()
                return req.future
        self._resolve(req, running_abort(f"server failed: {self.failure or 'shutting down'}"))
        return req.future

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the scheduler thread between forward passes; returns its future."""
        fut: Future = Future()
        with self._wake:
            if not self._stop:
                self._commands.append((fn, fut))
                self._wake.notify()
                return fut
        fut.set_exception(RuntimeError(f"server failed: {self.failure or 'shutting down'}"))
        return fut

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def fail(self, reason: str) -> None:
        """The ranks failed: stop scheduling; every request is answered with an abort."""
        with self._wake:
            self.failure = reason
            self._stop = True
            self._wake.notify()

    # ------------------------------------------------------------------ commands (scheduler thread)

    def pause(self, mode: str) -> int:
        """Pause in ``mode``; returns how many requests were aborted or retracted."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        self.paused = mode
        if mode == "abort":
            return self.abort(None)
        if mode == "retract":
            moved = list(self.running)
            self.running.clear()
            for req in reversed(moved):  # keep arrival order at the queue's front
                req.num_retractions += 1
                self.waiting.appendleft(req)
            return len(moved)
        return 0

    def resume(self) -> None:
        self.paused = None

    def abort(self, rid: str | None, message: str | None = None, status_code: int | None = None) -> int:
        """Finish request ``rid`` (or all, if None) with an abort; returns how many. The
        finish reasons are SGLang's: a running request's carries ``message`` (default
        "Aborted") and ``status_code``; a waiting one's says it never ran."""
        count = 0
        for req in list(self.running):
            if rid is None or req.rid == rid:
                self._finish_running(req, running_abort(message, status_code))
                count += 1
        for req in list(self.waiting):
            if rid is None or req.rid == rid:
                self.waiting.remove(req)
                self._resolve(req, waiting_abort())
                count += 1
        return count

    def stats(self) -> dict[str, Any]:
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "paused": self.paused is not None, "pause_mode": self.paused, "steps": self.steps,
                "weight_version": self.weight_version}

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._commands and (self.paused or not (self.waiting or self.running)):
                    self._wake.wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets the error
                    fut.set_exception(exc)
            if self.paused:
                continue
            try:
                self._step()
            except BaseException as exc:  # noqa: BLE001 - fail requests, keep serving
                log.exception("scheduler step failed")
                self.abort(None, f"internal error: {exc}")
        reason = f"server failed: {self.failure}" if self.failure else "server shutting down"
        with self._wake:
            commands = list(self._commands)
            self._commands.clear()
        for _, fut in commands:
            fut.set_exception(RuntimeError(reason))
        self.abort(None, reason)

    def _step(self) -> None:
        with self._wake:
            admitted = []
            if self._admit_now():
                while self.waiting and len(self.running) + len(admitted) < self.max_running:
                    admitted.append(self.waiting.popleft())
        decoding = list(self.running)
        if admitted:
            self._prefill(admitted)
        if decoding:
            self._decode(decoding)
        self.steps += 1

    def _admit_now(self) -> bool:
        """Prefill the waiting requests this step? Always when nothing runs; otherwise only
        once ``admit_batch`` slots are free (or every waiting request fits). Why: a prefill
        is a forward pass of its own, and with the queue full, admitting whenever one
        request finished put a one-row prefill beside nearly every decode step (the default
        recipe: 147 prefills to 167 decodes, most of them per-call overhead;
        bench_server_schedule.py)."""
        free = self.max_running - len(self.running)
        return not self.running or (free > 0 and free >= min(self.admit_batch, len(self.waiting)))

    def _prefill(self, reqs: list[Request]) -> None:
        """Prefill prompt (+ output kept from a retraction) into the next free slots.

        Requests with the same tokens (a group's samples of one prompt) share one row of
        the forward pass: the others get that row's logits and a copy of its KV cache, as
        SGLang's and vLLM's prefix caches share a prompt's KV. A request that wants its
        routed experts gets a row of its own (the routing is recorded per row)."""
        slot0 = len(self.running)
        seqs = [r.input_ids + r.output_ids for r in reqs]
        row_of: dict[tuple[int, ...], int] = {}  # tokens -> the row that runs them
        rows: list[int] = []  # indices into reqs that get a row
        copies: list[tuple[int, int]] = []  # (index into reqs, the row it copies)
        for i, (r, s) in enumerate(zip(reqs, seqs)):
            shareable, key = self.share_prefill and not r.return_routed_experts, tuple(s)
            if shareable and key in row_of:
                copies.append((i, row_of[key]))
                continue
            if shareable:
                row_of[key] = len(rows)
            rows.append(i)
        width = max(len(seqs[i]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for b, i in enumerate(rows):
            ids[b, :len(seqs[i])] = torch.tensor(seqs[i])
        lengths = torch.tensor([len(seqs[i]) for i in rows])
        dev = self.runner.device
        reqs = [reqs[i] for i in rows] + [reqs[i] for i, _ in copies]  # slot order: the rows, then the copies
        self.running.extend(reqs)  # before the forward: a failed step aborts them with the others
        logits = self.runner.forward(slot0, ids.to(dev), torch.zeros(len(rows), dtype=torch.long, device=dev),
                                     (lengths - 1).to(dev))
        self._keep_routing(reqs[:len(rows)], [0] * len(rows), lengths.tolist())
        if copies:
            src = [b for _, b in copies]
            for j, b in enumerate(src):  # before sampling: a request finishing there moves slots
                self.runner.move_slot(slot0 + b, slot0 + len(rows) + j, int(lengths[b]))
            logits = torch.cat([logits, logits[torch.tensor(src, device=logits.device)]])
        self._sample_and_advance(reqs, slot0, logits)

    def _decode(self, reqs: list[Request]) -> None:
        dev = self.runner.device
        last = torch.tensor([r.output_ids[-1] for r in reqs], device=dev).unsqueeze(1)
        start = torch.tensor([r.cached_len for r in reqs], device=dev)
        logits = self.runner.forward(0, last, start, torch.zeros(len(reqs), dtype=torch.long, device=dev))
        self._keep_routing(reqs, start.tolist(), [1] * len(reqs))
        self._sample_and_advance(reqs, 0, logits)

    def _keep_routing(self, reqs: list[Request], starts: list[int], fed: list[int]) -> None:
        """Record the routing of the positions each request fed (row b's ``fed[b]`` tokens
        from position ``starts[b]``) that it does not hold yet."""
        if not any(r.return_routed_experts for r in reqs):
            return
        routing = self.runner.last_routing()
        assert routing is not None  # the server refuses routed experts for a dense model
        for b, req in enumerate(reqs):
            if not req.return_routed_experts:
                continue
            for t in range(len(req.routing) - starts[b], fed[b]):
                req.routing.append(routing[b, t])

    def _sample_and_advance(self, reqs: list[Request], slot0: int, logits: torch.Tensor) -> None:
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
        top_k = torch.tensor([r.params.top_k for r in reqs], device=dev)
        tokens, logps = sample(logits, temp, top_p, top_k, self.generator)
        for req, tok, lp in zip(reqs, tokens.tolist(), logps.tolist()):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            req.versions.append(self.weight_version)
            reason = self._finish_reason(req, tok)
            if reason is not None:
                self._finish_running(req, reason)

    def _finish_reason(self, req: Request, tok: int) -> dict[str, Any] | None:
        p = req.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            return {"type": "stop", "matched": tok}
        if tok in p.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if p.stop:
            piece = self.tokenizer.decode([tok], skip_special_tokens=p.skip_special_tokens)
            req.text_tail = (req.text_tail + piece)[-256:]
            for s in p.stop:
                if s and s in req.text_tail:
                    return {"type": "stop", "matched": s}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(req.input_ids) + len(req.output_ids) >= self.context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _finish_running(self, req: Request, reason: dict[str, Any]) -> None:
        """Remove a running request, keeping running[i] <-> slot i dense."""
        i = self.running.index(req)
        last = len(self.running) - 1
        if i != last:
            moved = self.running[last]
            self.runner.move_slot(last, i, moved.cached_len + 1)
            self.running[i] = moved
        self.running.pop()
        self._resolve(req, reason)

    def _resolve(self, req: Request, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        if not req.future.done():
            req.future.set_result(req)

"""The embedded generation server: the pinned SGLang's native HTTP API over :class:`Engine`.

Endpoints (SGLang's names, bodies and reply shapes; see :mod:`realscale.serve.protocol`):
``/generate`` (also streamed: ``text/event-stream`` chunks ending with ``data: [DONE]``),
``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``, ``/init_weights_update_group``,
``/destroy_weights_update_group``, ``/begin_weight_update``,
``/update_weights_from_distributed``, ``/end_weight_update``, ``/update_weight_version``,
``/flush_cache``, ``/health``, ``/health_generate``, ``/ready``, ``/get_model_info``
(``/model_info``), ``/get_server_info`` (``/server_info``). A request the server cannot
honour gets HTTP 400 with ``{"error": "..."}`` naming the field (the weight routes add
SGLang's ``success``/``message``); unknown paths 404 and wrong methods 405, also as JSON.

A server has ``tp`` tensor-parallel ranks (:mod:`realscale.serve.ranks`; this process
is rank 0). Weight routes run on every rank through ``ranks.call_all``, as SGLang runs
them on every TP worker: ``/init_weights_update_group`` joins rank ``rank_offset +
tp_rank`` of the group (so ``world_size`` counts every rank of every server plus the
sender), ``/update_weights_from_distributed`` receives the broadcast full HF tensors on
every rank and keeps each rank's shard, ``/update_weights_from_disk`` loads each rank's
shard. Like SGLang's, these run in the scheduler between forward passes, so generation
waits while a weight group forms or a bucket arrives (the trainer pauses the servers for
an update anyway). ``GET /realscale/weight_hashes`` (ours, for tests) returns every rank's
hash per tensor of its flat weight buffer. If a rank dies, ``/health`` answers 503 and,
under :func:`serve`, the process exits with a log line saying which rank died.

Health as strict as SGLang's: ``/health`` is ``/health_generate`` (unless
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false, as in SGLang), a one-token probe
generation that, while the server is paused, waits for the resume and answers 503 after
``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (default 20; pinned SGLang: http_server.py:218,
721-799), so a client that probes a paused server fails here as it would on SGLang.
``/model_info`` and ``/get_server_info`` answer at once, paused or not. (Stricter on one
point: SGLang's waiting probe also passes when any other scheduler output arrives.)

Departures from SGLang, on purpose: ``n > 1``, penalties, grammars, multimodal inputs,
LoRA, input-token log-probs and the other features :mod:`~realscale.serve.protocol`
lists are refused with 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np
import torch
from aiohttp import web

from realscale.config import PAUSE_MODES
from realscale.inference.dialect import encode_routed_experts
from realscale.inference.sglang_reference import PINNED
from realscale.inference.weight_sync import FLATTENED
from realscale.models.tiny import resolve_model_path
from realscale.models.tokenizer import load_light_tokenizer
from realscale.serve import protocol as P
from realscale.serve import weight_world_routes
from realscale.serve.engine import Engine, Request, running_abort
from realscale.serve.ranks import ServerRanks
from realscale.serve.weights import read_hf_config

log = logging.getLogger(__name__)

SERVER_VERSION = "realscale-embedded-0.1"
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT (http_server.py:218)
HEALTH_POLL_S = 0.05  # how often a health probe waiting behind a pause looks again
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")


def context_length_for(model_dir: str, requested: int) -> int:
    """The context a server of ``model_dir`` accepts: ``requested`` (0: 2048), at most the
    model's ``max_position_embeddings``."""

    return min(requested or 2048, int(read_hf_config(model_dir).get("max_position_embeddings", 2048)))


class EmbeddedServer:
    """Model + tokenizer + engine + the aiohttp application that serves them."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_running: int = 32,
                 context_length: int = 0, weight_version: str = "0", seed: int = 0,
                 default_max_new_tokens: int = 128, tp: int = 1, threads: int = 1,
                 ranks: ServerRanks | None = None) -> None:
        """``tp`` ranks (this process and ``tp - 1`` spawned ones, ``threads`` torch
        threads each; this process's own thread count is the caller's), or ``ranks`` that
        already run (a colocated trainer's, :meth:`ServerRanks.of_running`; its KV cache
        must hold ``context_length_for(model_path, context_length)`` tokens)."""
        self.model_path = resolve_model_path(model_path)
        self.tokenizer = load_light_tokenizer(self.model_path)
        self.context_length = context_length_for(self.model_path, context_length)
        self.ranks = ranks or ServerRanks(self.model_path, tp, dtype=getattr(torch, dtype), device=device,
                                          max_slots=max_running, max_len=self.context_length, threads=threads)
        assert self.ranks.worker is not None
        self.hf_dict = self.ranks.worker.hf_dict  # config.json (transformers' config object costs seconds)
        eos = self.hf_dict.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.append(self.tokenizer.eos_token_id)
        self.engine = Engine(self.ranks, self.tokenizer, max_running=max_running, context_length=self.context_length,
                             weight_version=weight_version, seed=seed, eos_token_ids=eos_ids)
        self.ranks.on_failure = self._rank_failed
        self.on_failure: Any = None  # what serve() adds: exit the process
        self.device = self.ranks.device
        self.weight_session: str | None = None  # the selector of the open /begin_weight_update session
        self.default_max_new_tokens = default_max_new_tokens
        self.args = {"model_path": self.model_path, "device": device, "dtype": dtype, "max_running_requests": max_running,
                     "context_length": self.context_length, "random_seed": seed}
        # SGLang's health-check settings, read from SGLang's variables (module docstring)
        self.health_check_timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", HEALTH_CHECK_TIMEOUT_S))
        self.health_generates = _env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True)

    def _rank_failed(self, reason: str) -> None:
        self.engine.fail(reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    # ------------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/realscale/weight_hashes", self.weight_hashes)
        for method in ("GET", "POST"):
            r.add_route(method, "/flush_cache", self.flush_cache)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/ready", self.ready)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.get_model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.get_server_info)
        weight_world_routes.register(app, self)  # /realscale/*_weight_world, update_weights_reshard
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        self.close()

    def close(self) -> None:
        """Stop the scheduler and the ranks (a server used without HTTP calls this)."""
        self.engine.shutdown()
        self.ranks.shutdown()  # rank 0's weight groups too: frees their names in this process

    async def _engine_call(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.engine.call(fn))

    # ------------------------------------------------------------------ generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = P.parse_generate(await P.read_json(request), self.engine.vocab_size)
        reqs, fmt = self._requests(*body)
        for r in reqs:
            if r.params.max_new_tokens == 0:  # SGLang: nothing to generate, answer at once
                r.finish_reason = {"type": "length", "length": 0}
                r.future.set_result(r)
            else:
                self.engine.submit(r)
        if fmt["stream"]:
            return await self._stream(request, reqs, fmt)
        try:
            done = await asyncio.gather(*(asyncio.wrap_future(r.future) for r in reqs))
        except asyncio.CancelledError:  # the client went away (handler_cancellation): as SGLang, abort
            self._abort_unfinished(reqs)
            raise
        out = [self._response(r, fmt, i) for i, r in enumerate(done)]
        return web.json_response(out[0] if fmt["single"] else out)

    def _abort_unfinished(self, reqs: list[Request]) -> None:
        for r in reqs:
            if not r.future.done():
                self.engine.call(lambda rid=r.rid: self.engine.abort(rid))

    def _requests(self, batch: list[list[int]] | None, texts: list[str] | None,
                  req: dict[str, Any]) -> tuple[list[Request], dict[str, Any]]:
        """Engine requests for a parsed ``/generate`` body, and how to format the answers."""
        if texts is not None:
            batch = [self.tokenizer(t)["input_ids"] for t in texts]
            if any(not ids for ids in batch):
                raise P.ProtocolError("generate.text: an empty text has no tokens to continue from")
        assert batch is not None
        n = len(batch)
        raw_params = P.per_item(req, "sampling_params", n)
        logprob = P.per_item(req, "return_logprob", n, False)
        if not all(isinstance(v, bool) for v in logprob):
            raise P.ProtocolError("generate.return_logprob: expected a bool or a list of bools")
        routed = bool(req.get("return_routed_experts"))
        start = int(req.get("routed_experts_start_len") or 0)
        if routed and not self.engine.runner.has_experts:
            raise P.ProtocolError("generate.return_routed_experts: this model has no experts to report")
        reqs = []
        for rid, ids, raw, lp in zip(P.rid_list(req, n), batch, raw_params, logprob):
            if routed and start > len(ids):
                raise P.ProtocolError(f"generate.routed_experts_start_len: {start} is past the prompt's {len(ids)} "
                                      "tokens (it must be within the prompt)")
            if len(ids) >= self.context_length:
                raise P.ProtocolError(f"generate.input_ids: the input has {len(ids)} tokens; the context length is "
                                      f"{self.context_length}, so at most {self.context_length - 1} fit")
            opts = P.parse_sampling_params(raw, self.default_max_new_tokens)
            if opts.top_k >= self.engine.vocab_size:
                opts.top_k = -1  # SGLang's "all tokens" is 1 << 30; anything past the vocabulary is no cut
            reqs.append(Request(rid=rid or uuid.uuid4().hex, input_ids=list(ids), params=opts, return_logprob=lp,
                                return_routed_experts=routed, routed_experts_start_len=start))
        fmt = {"single": P.is_single(req), "stream": bool(req.get("stream")),
               "text_in_logprobs": bool(req.get("return_text_in_logprobs")),
               "prompt_token_ids": bool(req.get("return_prompt_token_ids")),
               "stream_interval": [P.stream_interval(raw) for raw in raw_params]}
        return reqs, fmt

    def _response(self, r: Request, fmt: dict[str, Any], index: int, upto: int | None = None) -> dict[str, Any]:
        """SGLang's answer for ``r``: final, or (``upto`` tokens) a streamed partial one."""
        final = upto is None
        k = len(r.output_ids) if final else upto
        ids, logprobs, versions = r.output_ids[:k], r.logprobs[:k], r.versions[:k]
        text = self.tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens)
        reason = (r.finish_reason or running_abort()) if final else None
        if reason and reason.get("type") == "stop" and isinstance(reason.get("matched"), str) \
                and not r.params.no_stop_trim:
            cut = text.find(reason["matched"])
            text = text[:cut] if cut >= 0 else text
        meta: dict[str, Any] = {
            "id": r.rid, "finish_reason": reason, "prompt_tokens": len(r.input_ids),
            "weight_version": versions[-1] if versions else self.engine.weight_version,
            "num_retractions": r.num_retractions, "reasoning_tokens": 0, "completion_tokens": k,
            "cached_tokens": 0, "weight_versions": P.version_spans(versions, self.engine.weight_version),
        }
        if r.return_logprob:
            pieces = ([self.tokenizer.decode([t]) for t in ids] if fmt["text_in_logprobs"] else [None] * k)
            meta["input_token_logprobs"] = []  # logprob_start_len = -1: output tokens only
            meta["output_token_logprobs"] = [[lp, tok, piece] for lp, tok, piece in zip(logprobs, ids, pieces)]
            meta["output_token_logprobs_length"] = k
        if final:
            meta["e2e_latency"] = time.monotonic() - r.created
            if r.return_routed_experts:
                rows = r.routing[r.routed_experts_start_len:]
                held = torch.stack(rows).numpy() if rows else np.zeros((0,), dtype=np.int32)
                meta["routed_experts"] = encode_routed_experts(held)
        out: dict[str, Any] = {"text": text, "output_ids": list(ids), "meta_info": meta}
        if fmt["prompt_token_ids"]:
            out["prompt_token_ids"] = list(r.input_ids)
        if not fmt["single"] and fmt["stream"]:
            out["index"] = index
        return out

    async def _stream(self, request: web.Request, reqs: list[Request], fmt: dict[str, Any]) -> web.StreamResponse:
        """SGLang's ``text/event-stream``: a ``data: {...}`` chunk (cumulative text, ids and
        meta_info) every ``stream_interval`` new tokens of a request, its final answer, and
        ``data: [DONE]`` at the end. A client that goes away aborts its requests."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = [0] * len(reqs)
        pending = set(range(len(reqs)))
        done = [asyncio.wrap_future(r.future) for r in reqs]
        try:
            while pending:
                # new tokens are polled (the engine appends them on its thread); a finish wakes at once
                await asyncio.wait([done[i] for i in pending], timeout=0.02, return_when=asyncio.FIRST_COMPLETED)
                for i in sorted(pending):
                    r, k = reqs[i], len(reqs[i].output_ids)
                    if r.future.done():
                        await resp.write(_sse(self._response(r, fmt, i)))
                        pending.discard(i)
                    elif k - sent[i] >= fmt["stream_interval"][i]:
                        await resp.write(_sse(self._response(r, fmt, i, upto=k)))
                        sent[i] = k
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self._abort_unfinished(reqs)
            raise
        await resp.write_eof()
        return resp

    async def abort_request(self, request: web.Request) -> web.Response:
        # SGLang: the route passes only rid / abort_all on, and answers 200 with no body;
        # an abort that names no request does nothing.
        what = "abort_request"
        body = P.check_object(await P.read_json(request), P.ABORT_FIELDS, what, strict=False)
        rid = P.optional(body, "rid", (str,), what)
        abort_all = P.optional(body, "abort_all", (bool,), what, False)
        if rid or abort_all:
            await self._engine_call(lambda: self.engine.abort(None if abort_all else rid))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = P.check_object(await P.read_json(request), P.PAUSE_FIELDS, "pause_generation", strict=False)
        mode = P.optional(body, "mode", (str,), "pause_generation", "abort")
        if mode not in PAUSE_MODES:
            raise P.ProtocolError(f"pause_generation.mode: {mode!r} is not one of 'abort', 'retract', 'in_place'")
        # a weight update begins: one line, so the log shows whether the server died holding half of one
        print(f"realscale serve: pausing generation (mode {mode})", flush=True)
        await self._engine_call(lambda: self.engine.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        P.check_object(await P.read_json(request), P.CONTINUE_FIELDS, "continue_generation", strict=False)
        await self._engine_call(self.engine.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # ------------------------------------------------------------------ weights
    # SGLang's update protocol: /init_weights_update_group once; each update is a session,
    # /begin_weight_update, /update_weights_from_distributed per bucket (refused outside a
    # session), /end_weight_update. Each successful update call records its weight_version
    # (clients send it with the last bucket) and, with flush_cache (the default), fails
    # when requests that hold KV of the old weights are still there, as SGLang 0.5.23 does.

    async def _on_all_ranks(self, method: str, *args: Any, version: str | None = None,
                            abort_all: bool = False) -> list[Any]:
        """``ranks.call_all(method, *args)`` between forward passes; then tag ``version``."""
        def run() -> list[Any]:
            if abort_all:
                self.engine.abort(None)
            out = self.ranks.call_all(method, *args)
            if version is not None:
                self.engine.weight_version = version
            return out

        return await self._engine_call(run)

    async def _cache_busy(self) -> bool:
        """Whether a cache flush would be refused, as the pinned SGLang decides it
        (``Scheduler.flush_cache``: ``is_fully_idle(ignore_waiting=self._engine_paused)``,
        scheduler.py:5518-5520 and 5337-5355 in 0.5.23): running requests always count;
        waiting ones only while not paused. Paused, SGLang's scheduler ignores its waiting
        queue (a retract pause moved the running requests there and freed their KV), and
        requests sent during a pause wait before its scheduler (tokenizer manager); the
        fidelity table (tests/inference/test_sglang_fidelity.py) checks both against it."""
        def busy() -> bool:
            e = self.engine
            return bool(e.running) or (not e.paused and bool(e.waiting))

        return await self._engine_call(busy)

    async def _flush_refused(self, body: dict[str, Any]) -> bool:
        """SGLang flushes the cache after an update (``flush_cache``, default true) and fails
        the update call when the flush is refused."""
        flush = P.optional(body, "flush_cache", (bool,), "flush_cache", True, lax=True)
        return flush and await self._cache_busy()

    @staticmethod
    def _updated(message: str, version: Any) -> str:
        return message if version is None else f"{message} Weight version updated to {version}."

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        what = "update_weights_from_disk"
        body = P.check_object(await P.read_json(request), P.DISK_FIELDS, what, strict=False)
        path = P.require(body, "model_path", (str,), what)
        version = P.optional(body, "weight_version", (str, int), what)
        abort_all = P.optional(body, "abort_all_requests", (bool,), what, False)
        if not os.path.isdir(path):
            return P.failure(f"{what}: model_path {path!r} is not a directory", num_paused_requests=0)
        try:
            await self._on_all_ranks("load_weights_from_disk", path, abort_all=abort_all,
                                     version=None if version is None else str(version))
        except RuntimeError as exc:
            return P.failure(f"{what}: {exc}", num_paused_requests=0)
        if await self._flush_refused(body):
            return P.failure(FLUSH_REFUSED, num_paused_requests=0)
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": self._updated("Succeeded to update model weights.", version)})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        what = "init_weights_update_group"
        body = P.check_object(await P.read_json(request), P.INIT_GROUP_FIELDS, what, strict=False)
        addr = P.require(body, "master_address", (str,), what)
        port = P.require(body, "master_port", (int,), what, lax=True)
        offset = P.require(body, "rank_offset", (int,), what, lax=True)
        world = P.require(body, "world_size", (int,), what, lax=True)
        group = P.optional(body, "group_name", (str,), what, P.DEFAULT_GROUP)
        backend = P.optional(body, "backend", (str,), what, "nccl")
        if backend == "nccl" and self.device.type != "cuda":
            backend = "gloo"  # SGLang's default names NCCL; a CPU server can only speak gloo
        if not 0 < offset <= world - self.ranks.tp:
            raise P.ProtocolError(f"{what}.rank_offset: this server's {self.ranks.tp} rank(s) join at rank_offset + "
                                  f"tp_rank, which must lie in [1, world_size={world}); got rank_offset {offset}")
        try:
            # every rank joins at rank_offset + tp_rank
            await self._on_all_ranks("init_weights_group", addr, port, offset, world, group, backend)
        except RuntimeError as exc:
            return P.failure(f"Failed to initialize custom process group: {exc}.")
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        what = "destroy_weights_update_group"
        body = P.check_object(await P.read_json(request), P.DESTROY_GROUP_FIELDS, what, strict=False)
        group = P.optional(body, "group_name", (str,), what, P.DEFAULT_GROUP)
        try:
            await self._on_all_ranks("destroy_weights_group", group)
        except RuntimeError:
            return P.failure("The group to be destroyed does not exist.")
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body = P.check_object(await P.read_json(request), P.BEGIN_FIELDS, "begin_weight_update", strict=False)
        selector = P.optional(body, "selector", (str,), "begin_weight_update", "all")
        if selector not in P.SELECTORS:
            raise P.ProtocolError(f"begin_weight_update.selector: {selector!r} is not one of {P.SELECTORS}")
        if self.weight_session is not None:
            return P.failure("a weight-update session is already open; call end_weight_update() first")
        self.weight_session = selector
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        P.check_object(await P.read_json(request), P.END_FIELDS, "end_weight_update", strict=False)
        if self.weight_session is None:
            return P.failure("no weight-update session is open; call begin_weight_update() first")
        self.weight_session = None
        try:  # a fused tensor (q/k/v, gate/up) sent in part is an error, not silently kept old
            await self._on_all_ranks("end_weight_update")
        except RuntimeError as exc:
            return P.failure(f"end_weight_update: {exc}")
        return web.json_response({"success": True, "message": "Success"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        what = "update_weights_from_distributed"
        body = P.check_object(await P.read_json(request), P.DIST_FIELDS, what, strict=False)
        names = P.require(body, "names", (list,), what)
        dtypes = P.require(body, "dtypes", (list,), what)
        shapes = P.require(body, "shapes", (list,), what)
        if not len(names) == len(dtypes) == len(shapes):
            raise P.ProtocolError(f"{what}: names, dtypes and shapes differ in length "
                                  f"({len(names)}, {len(dtypes)}, {len(shapes)})")
        if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
            raise P.ProtocolError(f"{what}.shapes: expected a list of lists of non-negative integers")
        group = P.optional(body, "group_name", (str,), what, P.DEFAULT_GROUP)
        version = P.optional(body, "weight_version", (str, int), what)
        abort_all = P.optional(body, "abort_all_requests", (bool,), what, False)
        load_format = P.optional(body, "load_format", (str,), what)
        if load_format not in (None, FLATTENED):
            raise P.ProtocolError(f"{what}.load_format: {load_format!r} is not supported (null or {FLATTENED!r})")
        if abort_all:
            await self._engine_call(lambda: self.engine.abort(None))
        if self.weight_session is None:
            return P.failure("update_weights_from_distributed must run between begin_weight_update() and "
                            "end_weight_update()")
        try:
            # every rank receives the full tensors and keeps its shard
            await self._on_all_ranks("receive_weights", names, dtypes, shapes, group, load_format,
                                     version=None if version is None else str(version))
        except RuntimeError as exc:
            return P.failure(f"Failed to update parameter online: {exc}.")
        if await self._flush_refused(body):
            return P.failure(FLUSH_REFUSED)
        return web.json_response({"success": True,
                                  "message": self._updated("Succeeded to update parameter online.", version)})

    async def weight_hashes(self, request: web.Request) -> web.Response:
        """Every rank's hash per tensor of its flat buffer (``realscale.serve.weights``)."""
        try:
            hashes = await self._on_all_ranks("weight_hashes")
        except RuntimeError as exc:
            return P.failure(f"weight_hashes: {exc}")
        return web.json_response({"tp_size": self.ranks.tp, "weight_version": self.engine.weight_version,
                                  "ranks": hashes})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        what = "update_weight_version"
        body = P.check_object(await P.read_json(request), P.VERSION_FIELDS, what, strict=False)
        version = str(P.require(body, "new_version", (str, int), what))
        abort_all = P.optional(body, "abort_all_requests", (bool,), what, True)

        def bump() -> None:
            if abort_all:
                self.engine.abort(None)
            self.engine.weight_version = version

        await self._engine_call(bump)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})

    # ------------------------------------------------------------------ housekeeping

    async def flush_cache(self, request: web.Request) -> web.Response:
        # There is no prefix cache to drop; like SGLang, refuse while requests hold KV.
        if await self._cache_busy():
            return web.Response(status=400, text="Flush cache failed: requests are running or waiting.\n")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    def _unhealthy(self) -> str | None:
        if self.ranks.failure is not None:
            return f"tensor-parallel ranks failed: {self.ranks.failure}"
        if not self.engine.alive():
            return "scheduler thread died"
        return None

    async def health(self, request: web.Request) -> web.Response:
        # SGLang: /health is the /health_generate handler unless
        # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false (http_server.py:721-723, 745-749)
        if self.health_generates:
            return await self.health_generate(request)
        if (reason := self._unhealthy()) is not None:
            return web.json_response({"error": reason}, status=503)
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        # SGLang: ready for new requests = healthy and not paused
        return web.Response(status=200 if self._unhealthy() is None and not self.engine.paused else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's probe (http_server.py:721-799): a one-token generation, 200 once the
        scheduler answers, 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds. SGLang's probe
        waits behind a pause like any request (tokenizer_manager.py:938-939), so while the
        server is paused this one waits for the resume and answers 503 at the timeout."""
        if (reason := self._unhealthy()) is not None:
            return web.json_response({"error": reason}, status=503)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.health_check_timeout
        failed = web.json_response({"error": f"no token generated within {self.health_check_timeout:g} s"},
                                   status=503)
        while self.engine.paused:
            if loop.time() >= deadline:
                return failed
            await asyncio.sleep(min(HEALTH_POLL_S, max(0.0, deadline - loop.time())))
        if self.engine.stats()["num_running_reqs"]:
            return web.Response(status=200)  # SGLang: a running batch answers within a step
        probe = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                        params=P.parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0}))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.submit(probe)),
                                   timeout=max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return failed
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        cfg = self.hf_dict
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": self.model_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": cfg.get("model_type"), "architectures": list(cfg.get("architectures") or []),
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        stats = self.engine.stats()
        return web.json_response({
            **self.args, **stats, "served_model_name": self.model_path, "tokenizer_path": self.model_path,
            "tp_size": self.ranks.tp, "dp_size": 1, "pp_size": 1, "max_context_length": self.context_length,
            "max_req_input_len": self.context_length - 1, "max_total_num_tokens": self.engine.max_running
            * self.context_length, "internal_states": [stats], "incremental_streaming_output": False,
            "disaggregation_mode": "null", "vocab_size": self.engine.vocab_size,
            # the protocol spoken is the pinned SGLang's; "frontend" says it is not SGLang
            "version": PINNED, "frontend": SERVER_VERSION, "realscale_rank_pids": self.ranks.pids(),
        })


def _env_bool(name: str, default: bool) -> bool:
    """A boolean variable as SGLang's ``EnvBool`` reads it (sglang/srt/environ.py:143-150)."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value.lower() in ("true", "1", "yes", "y"):
        return True
    if value.lower() in ("false", "0", "no", "n"):
        return False
    raise ValueError(f"{name}={value!r} is not a valid boolean value")


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except P.ProtocolError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return web.json_response({"error": f"{exc.reason}: {request.method} {request.path}"}, status=exc.status)
        raise


def serve(server: EmbeddedServer, host: str | None = "127.0.0.1", port: int | None = 30000, sock: Any = None,
          exit_grace: float = 2.0) -> int:
    """Run until interrupted (or on ``sock``, a bound socket); returns the exit code: 1
    when a rank died (the server answers ``/health`` with 503 for ``exit_grace`` seconds,
    then exits, so launchers and clients route around it), else 0."""

    def exit_soon(reason: str) -> None:
        print(f"realscale serve: tensor-parallel {reason}; the server is unhealthy and exits", file=sys.stderr,
              flush=True)
        threading.Timer(exit_grace, os.kill, (os.getpid(), signal.SIGTERM)).start()

    server.on_failure = exit_soon
    if sock is not None:
        host = port = None
    web.run_app(server.app(), host=host, port=port, sock=sock, print=None, handle_signals=True, access_log=None,
                handler_cancellation=True)  # a client that goes away aborts its requests
    return 1 if server.ranks.failure is not None else 0


def start_in_thread(server: EmbeddedServer, host: str = "127.0.0.1", port: int = 0) -> tuple[str, Any]:
    """Serve in a background thread (tests, benchmarks); returns (base URL, stop function)."""

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, host, port)
    loop.run_until_complete(site.start())
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, name="realscale-http", daemon=True)
    thread.start()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    return f"http://{host}:{bound}", stop

"""The embedded generation server: SGLang's native HTTP API over :class:`Engine`.

Endpoints (SGLang names and bodies; see :mod:`realscale.generate.protocol`):
``/generate``, ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``, ``/flush_cache``,
``/health``, ``/health_generate``, ``/get_model_info`` (``/model_info``),
``/get_server_info`` (``/server_info``). Every bad request gets HTTP 400 with
``{"error": "..."}``; unknown paths 404 and wrong methods 405, also as JSON.

Departures from SGLang, on purpose: ``/health_generate`` answers 200 while the server
is paused or busy if the scheduler is alive (SGLang would queue its probe behind the
pause); streaming, ``n > 1``, penalties and grammars are refused with 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import glob
import json
import logging
import os
import time
import uuid
from typing import Any

from aiohttp import web

from realscale.generate import protocol as P
from realscale.generate import weight_world_routes
from realscale.generate.engine import Engine, Request
from realscale.generate.weight_sync import WeightReceiver

log = logging.getLogger(__name__)

SERVER_VERSION = "realscale-embedded-0.1"


def load_safetensors_dir(path: str) -> list[tuple[str, Any]]:
    """Every tensor of every ``*.safetensors`` file in ``path``, HF names."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise ValueError(f"model_path {path!r} is not a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model_path {path!r} holds no *.safetensors files")
    named: list[tuple[str, Any]] = []
    for f in files:
        named.extend(load_file(f).items())
    return named


class EmbeddedServer:
    """Model + tokenizer + engine + the aiohttp application that serves them."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_running: int = 32,
                 context_length: int = 0, weight_version: str = "0", seed: int = 0,
                 default_max_new_tokens: int = 128) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from realscale.models.tiny import resolve_model_path

        self.model_path = resolve_model_path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype))
        model = model.to(device).eval()
        max_pos = int(getattr(model.config, "max_position_embeddings", 2048))
        self.context_length = min(context_length or 2048, max_pos)
        eos = model.config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.append(self.tokenizer.eos_token_id)
        self.engine = Engine(model, self.tokenizer, max_running=max_running, context_length=self.context_length,
                             weight_version=weight_version, seed=seed, eos_token_ids=eos_ids)
        self.device = torch.device(device)
        self.receiver = WeightReceiver()
        self.default_max_new_tokens = default_max_new_tokens
        self.args = {"model_path": self.model_path, "device": device, "dtype": dtype, "max_running_requests": max_running,
                     "context_length": self.context_length, "random_seed": seed}
        # Blocking work (weight rendezvous, receives, disk reads) runs here, off the event loop.
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="realscale-io")

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
        for method in ("GET", "POST"):
            r.add_route(method, "/flush_cache", self.flush_cache)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.get_model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.get_server_info)
        weight_world_routes.register(app, self)  # /realscale/*_weight_world, update_weights_reshard
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        self.engine.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _engine_call(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.engine.call(fn))

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ------------------------------------------------------------------ generation

    async def generate(self, request: web.Request) -> web.Response:
        batch, texts, req = P.parse_generate(await _body(request), self.engine.vocab_size)
        if texts is not None:
            batch = [self.tokenizer(t)["input_ids"] for t in texts]
            if any(not ids for ids in batch):
                raise P.ProtocolError("generate.text: an empty text has no tokens to continue from")
        assert batch is not None
        opts = P.parse_sampling_params(req.get("sampling_params"), self.default_max_new_tokens)
        rids = P.rid_list(req, len(batch))
        for ids in batch:
            if len(ids) >= self.context_length:
                raise P.ProtocolError(f"generate.input_ids: the input has {len(ids)} tokens; the context length is "
                                      f"{self.context_length}, so at most {self.context_length - 1} fit")
        reqs = [Request(rid=rid or uuid.uuid4().hex, input_ids=list(ids), params=copy.deepcopy(opts),
                        return_logprob=bool(req.get("return_logprob"))) for rid, ids in zip(rids, batch)]
        futures = []
        for r in reqs:
            if r.params.max_new_tokens == 0:  # SGLang: nothing to generate, answer at once
                r.finish_reason = {"type": "length", "length": 0}
                r.future.set_result(r)
            else:
                self.engine.submit(r)
            futures.append(asyncio.wrap_future(r.future))
        done = await asyncio.gather(*futures)
        out = [self._response(r) for r in done]
        single = isinstance(req.get("text"), str) or (req.get("input_ids") is not None and len(batch) == 1
                                                       and not isinstance(req["input_ids"][0], list))
        return web.json_response(out[0] if single else out)

    def _response(self, r: Request) -> dict[str, Any]:
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.params.skip_special_tokens)
        reason = r.finish_reason or {"type": "abort", "message": "unknown"}
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), str) and not r.params.no_stop_trim:
            cut = text.find(reason["matched"])
            text = text[:cut] if cut >= 0 else text
        meta: dict[str, Any] = {
            "id": r.rid, "finish_reason": reason, "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(r.output_ids), "cached_tokens": 0,
            "weight_version": r.versions[-1] if r.versions else self.engine.weight_version,
            "weight_versions": P.version_spans(r.versions, self.engine.weight_version),
            "num_retractions": r.num_retractions, "e2e_latency": time.monotonic() - r.created,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(r.logprobs, r.output_ids)]
        return {"text": text, "output_ids": list(r.output_ids), "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        body = P.check_object(await _body(request), P.ABORT_FIELDS, "abort_request")
        rid = P.optional(body, "rid", (str,), "abort_request")
        abort_all = P.optional(body, "abort_all", (bool,), "abort_request", False)
        if not rid and not abort_all:
            raise P.ProtocolError("abort_request: give 'rid' or 'abort_all': true")
        message = P.optional(body, "abort_message", (str,), "abort_request", "aborted by request")
        n = await self._engine_call(lambda: self.engine.abort(None if abort_all else rid, message))
        return web.json_response({"success": True, "num_aborted": n})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = P.check_object(await _body(request), P.PAUSE_FIELDS, "pause_generation")
        mode = P.optional(body, "mode", (str,), "pause_generation", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise P.ProtocolError(f"pause_generation.mode: {mode!r} is not one of 'abort', 'retract', 'in_place'")
        await self._engine_call(lambda: self.engine.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        P.check_object(await _body(request), P.CONTINUE_FIELDS, "continue_generation")
        await self._engine_call(self.engine.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # ------------------------------------------------------------------ weights

    async def _load(self, named: list[tuple[str, Any]], version: str | None, abort_all: bool) -> int:
        def swap() -> int:
            if abort_all:
                self.engine.abort(None, "aborted for a weight update")
            return self.engine.load_weights(named, version)

        return await self._engine_call(swap)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        what = "update_weights_from_disk"
        body = P.check_object(await _body(request), P.DISK_FIELDS, what)
        path = P.require(body, "model_path", (str,), what)
        version = P.optional(body, "weight_version", (str, int), what)
        abort_all = P.optional(body, "abort_all_requests", (bool,), what, False)
        try:
            named = await self._blocking(load_safetensors_dir, path)
            n = await self._load(named, None if version is None else str(version), abort_all)
        except (ValueError, KeyError, OSError) as exc:
            return _failure(f"{what}: {exc}")
        return web.json_response({"success": True, "message": f"Loaded {n} tensors from {path}; weight version "
                                  f"{self.engine.weight_version}.", "num_paused_requests": 0})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        what = "init_weights_update_group"
        body = P.check_object(await _body(request), P.INIT_GROUP_FIELDS, what)
        addr = P.require(body, "master_address", (str,), what)
        port = P.require(body, "master_port", (int,), what)
        rank = P.require(body, "rank_offset", (int,), what)
        world = P.require(body, "world_size", (int,), what)
        group = P.optional(body, "group_name", (str,), what, "weight_update_group")
        backend = P.optional(body, "backend", (str,), what, "nccl")
        if backend == "nccl" and self.device.type != "cuda":
            backend = "gloo"  # SGLang's default names NCCL; a CPU server can only speak gloo
        if not 0 < rank < world:
            raise P.ProtocolError(f"{what}.rank_offset: must be in [1, world_size={world}), got {rank}")
        try:
            await self._blocking(self.receiver.init_group, addr, port, rank, world, group, backend, self.device)
        except (ValueError, RuntimeError) as exc:
            return _failure(f"{what}: {exc}")
        return web.json_response({"success": True, "message": f"Joined {group!r} as rank {rank} of {world}."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = P.check_object(await _body(request), {"group_name", "rid"}, "destroy_weights_update_group")
        group = P.optional(body, "group_name", (str,), "destroy_weights_update_group", "weight_update_group")
        try:
            self.receiver.destroy_group(group)
        except ValueError as exc:
            return _failure(f"destroy_weights_update_group: {exc}")
        return web.json_response({"success": True, "message": f"Destroyed {group!r}."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        what = "update_weights_from_distributed"
        body = P.check_object(await _body(request), P.DIST_FIELDS, what)
        names = P.require(body, "names", (list,), what)
        dtypes = P.require(body, "dtypes", (list,), what)
        shapes = P.require(body, "shapes", (list,), what)
        if not len(names) == len(dtypes) == len(shapes):
            raise P.ProtocolError(f"{what}: names, dtypes and shapes differ in length "
                                  f"({len(names)}, {len(dtypes)}, {len(shapes)})")
        if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
            raise P.ProtocolError(f"{what}.shapes: expected a list of lists of non-negative integers")
        group = P.optional(body, "group_name", (str,), what, "weight_update_group")
        version = P.optional(body, "weight_version", (str, int), what)
        abort_all = P.optional(body, "abort_all_requests", (bool,), what, False)
        try:
            named = await self._blocking(self.receiver.receive, names, dtypes, shapes, group)
            n = await self._load(named, None if version is None else str(version), abort_all)
        except (ValueError, KeyError, RuntimeError) as exc:
            return _failure(f"{what}: {exc}")
        return web.json_response({"success": True, "message": f"Updated {n} tensors; weight version "
                                  f"{self.engine.weight_version}."})

    # ------------------------------------------------------------------ housekeeping

    async def flush_cache(self, request: web.Request) -> web.Response:
        # There is no prefix cache to drop; like SGLang, refuse while requests are in flight.
        stats = self.engine.stats()
        if stats["num_running_reqs"] or stats["num_waiting_reqs"]:
            return _failure("flush_cache: requests are running or waiting; the cache was not flushed")
        return web.Response(text="Cache flushed.\n")

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.alive():
            return web.json_response({"error": "scheduler thread died"}, status=503)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.engine.alive():
            return web.json_response({"error": "scheduler thread died"}, status=503)
        stats = self.engine.stats()
        if stats["paused"] or stats["num_running_reqs"]:
            return web.Response(status=200)
        probe = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                        params=P.parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0}))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.submit(probe)), timeout=20)
        except asyncio.TimeoutError:
            return web.json_response({"error": "no token generated within 20 s"}, status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.model.config
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
            "model_type": cfg.model_type, "architectures": list(cfg.architectures or []),
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.args, **self.engine.stats(), "version": SERVER_VERSION,
                                  "vocab_size": self.engine.vocab_size})


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise P.ProtocolError(f"request body is not valid JSON: {exc}") from None


def _failure(message: str) -> web.Response:
    """SGLang's failure shape (success/message) plus our uniform ``error`` field, HTTP 400."""
    return web.json_response({"success": False, "message": message, "error": message}, status=400)


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


def serve(server: EmbeddedServer, host: str = "127.0.0.1", port: int = 30000) -> None:
    """Run until interrupted; prints one line when ready."""
    web.run_app(server.app(), host=host, port=port, print=None,
                handle_signals=True, access_log=None)


def start_in_thread(server: EmbeddedServer, host: str = "127.0.0.1", port: int = 0) -> tuple[str, Any]:
    """Serve in a background thread (tests, benchmarks); returns (base URL, stop function)."""
    import threading

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app(), access_log=None)
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

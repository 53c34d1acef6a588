"""A fleet of load servers: many generation servers with no model, in one process, on loopback.

Each :class:`LoadServer` answers the generate protocol of a real engine, SGLang's
(``POST /generate``, pinned 0.5.23) or vLLM's (``POST /inference/v1/generate``, 0.32), in
the engine's own reply shape, so that the real :class:`realscale.inference.client.InferenceClient`
(its dialects, stitching, retries), the rollout controller, the workflow, the reward
workers and the batch packing can be driven at cluster scale on one machine
(``benchmarks/bench_rollout_tier.py``). What it scripts instead of a model:

- **decode**: every running request produces ``rate`` tokens per second; a server runs at
  most ``slots`` requests at once (``--max-running-requests``), the rest wait in its
  queue, first come first served;
- **answer lengths**: drawn per answer from a :class:`LengthLaw` (a lognormal, or the
  long-tail task's power law scaled to the answer cap), cut at the request's
  ``max_new_tokens`` (finish reason ``length``); a shorter one ends with an end-of-sequence
  token (``stop``);
- **tokens**: a filler text cycled, then one of the ``answers`` tails (e.g. ``\\boxed{42}``)
  and the end-of-sequence id, so that the workflow's decode and the math reward see text.
  The reply's bytes are sliced out of JSON fragments encoded once, so a reply costs the
  fleet a few copies, not an encode per token;
- **pause / resume** for weight updates, as the dialects call them. An abort pause
  answers every held request at once with its partial output (finish reason ``abort``)
  and then, as SGLang 0.5.23's ``pause_generation`` does while aborted requests are
  still being answered (``tokenizer_manager.py:2274-2280``: ``abort_request(abort_all)``,
  then ``asyncio.sleep(1.0)`` until ``model_update_lock`` is free), returns after
  ``abort_poll_s`` (1 s for SGLang; 0 for vLLM). Requests that arrive while paused wait
  for the resume (SGLang: ``tokenizer_manager.py:938-939``). Weight loads only move the
  weight version that the replies carry.

How it departs from a real engine: the decode rate does not depend on the batch or the
context; there is no prefill; an interrupted answer is continued from the ``rid`` the
client gives each segment (``<rid>-<interruptions>-<resends>``, client.py): the first
segment draws the answer's length, later ones continue it, so the fleet relies on that
naming; the ``text`` of a reply is the concatenation of its tokens' pieces (exact for the
byte-level tokenizers the benchmark uses). Sampled log-probs are a fixed cycle.

``python benchmarks/_load_fleet.py --servers 36 --slots 256 --script S.json`` runs a fleet
until its stdin closes and prints one JSON line with the servers' URLs first;
``GET /fleet/stats`` on any of them gives the fleet's counters (tokens and replies sent,
requests held: peak and now), ``POST /fleet/reset`` restarts the peak, ``POST /fleet/rate
{"rate": R}`` sets every request's decode rate, running ones included.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

DIALECTS = ("sglang", "vllm")
LOGPROBS = (-0.25, -1.5, -0.0625, -3.0, -0.5, -0.125)  # the sampled tokens' log-probs, cycled


# ---------------------------------------------------------------------- what the fleet generates


@dataclass(frozen=True)
class LengthLaw:
    """Answer lengths in tokens: ``lognormal:MEDIAN:SIGMA`` or ``powerlaw:MIN:MAX:ALPHA``
    (P(n) ∝ n^-alpha on MIN..MAX, the long-tail task's law, realscale/tasks/long_tail.py)."""

    kind: str
    a: float
    b: float
    c: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "LengthLaw":
        kind, _, rest = text.partition(":")
        try:
            nums = [float(x) for x in rest.split(":")]
        except ValueError:
            nums = []
        if kind == "lognormal" and len(nums) == 2 and nums[0] > 0 and nums[1] >= 0:
            return cls(kind, nums[0], nums[1])
        if kind == "powerlaw" and len(nums) == 3 and 1 <= nums[0] < nums[1] and nums[2] > 0 and nums[2] != 1:
            return cls(kind, nums[0], nums[1], nums[2])
        raise ValueError(f"answer lengths {text!r}: expected lognormal:MEDIAN:SIGMA or powerlaw:MIN:MAX:ALPHA "
                         "(alpha != 1)")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "lognormal":
            return max(1, round(rng.lognormvariate(math.log(self.a), self.b)))
        lo, hi, e = self.a ** (1 - self.c), self.b ** (1 - self.c), 1 / (1 - self.c)
        return max(1, round((lo + rng.random() * (hi - lo)) ** e))  # inverse CDF of the continuous law

    def describe(self) -> str:
        if self.kind == "lognormal":
            return f"lognormal (median {self.a:.0f}, sigma {self.b:.2f})"
        return f"power law n^-{self.c:g} on {self.a:.0f}..{self.b:.0f}"


@dataclass(frozen=True)
class Script:
    """The fleet's behaviour: decode rate, slots, lengths, and the tokens it emits."""

    rate: float                          # tokens per second of each running request (POST /fleet/rate moves it)
    slots: int                           # running requests per server; more wait in its queue
    lengths: LengthLaw
    filler: tuple[tuple[int, str], ...]  # (token id, its text), cycled to make up an answer
    answers: tuple[tuple[tuple[int, str], ...], ...]  # answer tails, one drawn per answer
    eos_id: int
    abort_poll_s: float = 1.0            # an abort pause lasts this long once something was aborted
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "slots": self.slots, "lengths": [self.lengths.kind, self.lengths.a,
                                                                    self.lengths.b, self.lengths.c],
                "filler": [list(t) for t in self.filler], "answers": [[list(t) for t in a] for a in self.answers],
                "eos_id": self.eos_id, "abort_poll_s": self.abort_poll_s, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Script":
        return cls(float(d["rate"]), int(d["slots"]), LengthLaw(*d["lengths"]),
                   tuple((int(i), str(s)) for i, s in d["filler"]),
                   tuple(tuple((int(i), str(s)) for i, s in a) for a in d["answers"]), int(d["eos_id"]),
                   float(d.get("abort_poll_s", 1.0)), int(d.get("seed", 0)))


class _Fragments:
    """Tokens as pre-encoded JSON pieces, each led by a comma, with the byte offset where
    every token's piece starts: any run of tokens is one slice."""

    def __init__(self, tokens: list[tuple[int, str]], dialect: str) -> None:
        self.ids, self.lps, self.text = bytearray(), bytearray(), []
        self.id_off, self.lp_off, self.text_off = [0], [0], [0]
        for k, (tok, piece) in enumerate(tokens):
            lp = LOGPROBS[k % len(LOGPROBS)]
            self.ids += b",%d" % tok
            if dialect == "sglang":  # [logprob, token_id, text or null] (return_text_in_logprobs off)
                self.lps += b",[%r,%d,null]" % (lp, tok)
            else:  # GenerateLogProbsContent with logprobs=0: the sampled token, also as its one top entry
                self.lps += (b',{"token_id":%d,"logprob":%r,"rank":1,"top_logprobs":[{"token_id":%d,"logprob":%r,'
                             b'"rank":1}]}' % (tok, lp, tok, lp))
            self.text.append(piece)
            self.id_off.append(len(self.ids))
            self.lp_off.append(len(self.lps))
            self.text_off.append(self.text_off[-1] + len(piece))
        self.ids, self.lps = bytes(self.ids), bytes(self.lps)
        self.joined = "".join(self.text)

    def __len__(self) -> int:
        return len(self.id_off) - 1

    def part(self, a: int, b: int) -> tuple[bytes, bytes, str]:
        """(ids, log-probs, text) of tokens a..b, each JSON piece led by a comma."""
        return (self.ids[self.id_off[a]:self.id_off[b]], self.lps[self.lp_off[a]:self.lp_off[b]],
                self.joined[self.text_off[a]:self.text_off[b]])


class TokenSource:
    """The tokens of every answer: filler up to its length minus the tail, then the tail."""

    def __init__(self, script: Script, dialect: str, longest: int) -> None:
        reps = -(-longest // max(1, len(script.filler)))
        self.filler = _Fragments(list(script.filler) * reps, dialect)
        self.tails = [_Fragments([*tail, (script.eos_id, "")], dialect) for tail in script.answers]

    def segment(self, length: int, tail: int, a: int, b: int, stops: bool) -> tuple[bytes, bytes, str]:
        """Tokens a..b of an answer of ``length`` tokens that ends with tail ``tail`` (when
        it ``stops``; an answer cut at its budget is filler all the way)."""
        t = self.tails[tail]
        body = length - len(t) if stops else length
        body = max(0, min(body, len(self.filler)))
        parts = []
        if a < body:
            parts.append(self.filler.part(a, min(b, body)))
        if b > body:
            lo, hi = max(a, body) - body, min(b - body, len(t))
            parts.append(t.part(lo, hi))
        if len(parts) == 1:
            return parts[0]
        return b"".join(p[0] for p in parts), b"".join(p[1] for p in parts), "".join(p[2] for p in parts)


# ---------------------------------------------------------------------- one server


@dataclass
class _Answer:
    """One answer across its segments (the client resubmits an interrupted one)."""

    length: int
    budget: int
    tail: int
    done: int = 0


@dataclass
class _Held:
    """A request on the server: waiting for a slot, or running (``left`` tokens to make in
    this segment, ``base`` of them made before ``since``, the last change of rate)."""

    rid: str
    fut: asyncio.Future
    left: int
    running: bool = False
    base: float = 0.0
    since: float = 0.0
    timer: asyncio.TimerHandle | None = None

    def made(self, rate: float, now: float) -> int:
        return min(self.left, int(self.base + (now - self.since) * rate)) if self.running else 0

    def time(self, rate: float, now: float) -> None:
        """(Re)arm the timer that ends the segment, at ``rate`` from ``now``."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(max(0.0, self.left - self.base) / rate, _settle,
                                                           self.fut, "done")


@dataclass
class Counters:
    tokens: int = 0
    replies: int = 0
    finished: int = 0  # replies that end their answer (not aborted)
    held: int = 0
    peak_held: int = 0
    aborted: int = 0


@dataclass
class _Shared:
    """What the servers of one fleet share: counters, and the answers in progress (the
    client may resume an interrupted answer on another server)."""

    rate: float
    counters: Counters = field(default_factory=Counters)
    answers: dict[str, "_Answer"] = field(default_factory=dict)
    servers: list["LoadServer"] = field(default_factory=list)

    def set_rate(self, rate: float) -> None:
        """A new decode rate for every request, also the running ones (their timers move)."""
        now = time.monotonic()
        for server in self.servers:
            for held in server.running():
                held.base, held.since = held.base + (now - held.since) * self.rate, now
        self.rate = rate
        for server in self.servers:
            for held in server.running():
                held.time(rate, now)

    def hold(self, n: int) -> None:
        c = self.counters
        c.held += n
        c.peak_held = max(c.peak_held, c.held)


class LoadServer:
    """One generation server of the fleet (module docstring)."""

    def __init__(self, script: Script, dialect: str, tokens: TokenSource, shared: _Shared, index: int) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r} is not one of {DIALECTS}")
        self.script, self.dialect, self.tokens, self.shared = script, dialect, tokens, shared
        self.rng = random.Random(script.seed * 100_003 + index)
        self.version = "0" if dialect == "sglang" else "default"
        self.paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._slots = asyncio.Semaphore(script.slots)
        self._held: dict[str, _Held] = {}

    # ------------------------------------------------------------------ routes

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        r = app.router
        r.add_get("/fleet/stats", self.fleet_stats)
        r.add_post("/fleet/reset", self.fleet_reset)
        r.add_post("/fleet/rate", self.fleet_rate)
        if self.dialect == "sglang":
            r.add_post("/generate", self.generate)
            r.add_post("/pause_generation", self.pause_generation)
            r.add_post("/continue_generation", self.continue_generation)
            r.add_post("/abort_request", self.abort_request)
            r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
            r.add_post("/update_weight_version", self.update_weight_version)
            r.add_get("/health", self.health_generate)  # SGLang's /health generates (http_server.py:721-723)
            r.add_get("/health_generate", self.health_generate)
            r.add_get("/model_info", self.model_info)
            r.add_get("/get_model_info", self.model_info)
            r.add_get("/get_server_info", self.server_info)
        else:
            r.add_post("/inference/v1/generate", self.generate)
            r.add_post("/pause", self.vllm_pause)
            r.add_post("/resume", self.vllm_resume)
            r.add_post("/reset_prefix_cache", self.ok)
            r.add_post("/collective_rpc", self.collective_rpc)
            r.add_post("/update_weight_version", self.update_weight_version)
            r.add_get("/health", self.ok)  # vLLM's /health only asks whether the engine is alive
        return app

    async def generate(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        if self.dialect == "sglang":
            ids, params, rid = body["input_ids"], body.get("sampling_params") or {}, str(body.get("rid") or "")
            budget = int(params.get("max_new_tokens", 128))
        else:
            ids, params, rid = body["token_ids"], body.get("sampling_params") or {}, str(body.get("request_id") or "")
            budget = int(params.get("max_tokens", 16))
        start = time.monotonic()
        await self._resumed.wait()  # a paused server holds new requests until the resume
        answer = self._answer(rid, budget)
        n, reason, ran = await self._decode(rid, answer, budget)
        a = answer.done
        answer.done += n
        c = self.shared.counters
        if reason != "abort":
            self.shared.answers.pop(_base(rid), None)
            c.finished += 1
        c.tokens += n
        c.replies += 1
        seg = self.tokens.segment(answer.length, answer.tail, a, a + n, answer.length <= answer.budget)
        if self.dialect == "sglang":
            raw = self._sglang_reply(rid, len(ids), n, _sglang_finish(reason, ran, budget, self.script.eos_id), seg,
                                     time.monotonic() - start)
        else:
            raw = self._vllm_reply(rid, len(ids), n, reason, seg)
        return web.Response(body=raw, content_type="application/json")

    # ------------------------------------------------------------------ decode

    def _answer(self, rid: str, budget: int) -> _Answer:
        """The answer this segment continues (the client's ``<rid>-<i>-<r>``), or a new one."""
        key = _base(rid)
        answer = self.shared.answers.get(key) if key else None
        if answer is None or answer.budget - answer.done != budget:
            answer = _Answer(self.script.lengths.draw(self.rng), budget, self.rng.randrange(len(self.tokens.tails)))
            if key:
                self.shared.answers[key] = answer
        return answer

    async def _decode(self, rid: str, answer: _Answer, budget: int) -> tuple[int, str, bool]:
        """Hold the request for its tokens' time; (tokens, finish type, whether it ran)."""
        left = max(0, min(budget, answer.length - answer.done))
        held = _Held(rid or str(id(answer)), asyncio.get_running_loop().create_future(), left)
        self._held[held.rid] = held
        self.shared.hold(1)
        try:
            async with self._slots:
                if held.fut.done():  # aborted while it waited for a slot
                    return 0, "abort", False
                held.running, held.since = True, time.monotonic()
                held.time(self.shared.rate, held.since)
                outcome = await held.fut
                held.timer.cancel()
        finally:
            self._held.pop(held.rid, None)
            self.shared.hold(-1)
        if outcome == "done":
            return left, ("stop" if answer.done + left >= answer.length else "length"), True
        self.shared.counters.aborted += 1
        return held.made(self.shared.rate, time.monotonic()), "abort", True

    def running(self) -> list[_Held]:
        return [h for h in self._held.values() if h.running and not h.fut.done()]

    def _abort(self, rid: str | None) -> int:
        targets = list(self._held.values()) if rid is None else [h for h in (self._held.get(rid),) if h]
        for held in targets:
            _settle(held.fut, "abort")
        return len(targets)

    # ------------------------------------------------------------------ replies

    def _sglang_reply(self, rid: str, prompt: int, n: int, finish: dict[str, Any], seg: tuple[bytes, bytes, str],
                      latency: float) -> bytes:
        """SGLang 0.5.23's ``/generate`` answer (tokenizer_manager.py:2507-2513, 2553-2565,
        2651-2655; logprobs :2865-2870; spans utils/weight_versions.py:99-107)."""
        v = json.dumps(self.version)
        ids, lps, text = seg
        return b"".join((
            b'{"text":', json.dumps(text).encode(), b',"output_ids":[', ids[1:], b'],"meta_info":{"id":',
            json.dumps(rid).encode(), b',"finish_reason":', json.dumps(finish).encode(),
            b',"prompt_tokens":%d,"weight_version":%s,"num_retractions":0,"input_token_logprobs":[],'
            b'"output_token_logprobs":[' % (prompt, v.encode()), lps[1:],
            b'],"output_token_logprobs_length":%d,"reasoning_tokens":0,"completion_tokens":%d,"cached_tokens":0,'
            b'"weight_versions":[{"version":%s,"start":0,"end":%d}],"e2e_latency":%r}}'
            % (n, n, v.encode(), n, round(latency, 6))))

    def _vllm_reply(self, rid: str, prompt: int, n: int, reason: str, seg: tuple[bytes, bytes, str]) -> bytes:
        """vLLM 0.32's ``GenerateTokensResponse.model_dump()`` (token_in_token_out/protocol.py:
        364-431, 495-527; built in serving.py:449-516; logprobs :784-815)."""
        v = json.dumps(self.version).encode()
        ids, lps, _ = seg
        return b"".join((
            b'{"request_id":', json.dumps(rid).encode(), b',"model":"load-fleet","created":%d,' % int(time.time()),
            b'"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,"prompt_tokens_details":null},'
            % (prompt, prompt + n, n),
            b'"prompt_logprobs":null,"prompt_token_id_logprobs":null,"prompt_token_ids":null,"mm_placeholders":null,'
            b'"metrics":null,"kv_transfer_params":null,"ec_transfer_params":null,"output_mode":"tokens",'
            b'"choices":[{"index":0,"finish_reason":', json.dumps(reason).encode(),
            b',"stop_reason":null,"token_ids":[', ids[1:], b'],"routed_experts":null,"sampling_mask":null,'
            b'"weight_versions":[{"version":', v, b',"start":0,"end":%d}],"logprobs":{"content":[' % n, lps[1:],
            b']}}]}'))

    # ------------------------------------------------------------------ control

    async def _pause(self, abort: bool) -> int:
        self.paused = True
        self._resumed.clear()
        n = self._abort(None) if abort else 0
        if n and self.script.abort_poll_s > 0:
            await asyncio.sleep(self.script.abort_poll_s)
        return n

    def _resume(self) -> None:
        self.paused = False
        self._resumed.set()

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json(request)
        await self._pause(body.get("mode", "abort") == "abort")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self._resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def vllm_pause(self, request: web.Request) -> web.Response:
        await self._pause(request.query.get("mode", "abort") == "abort")
        return web.json_response({"status": "paused"})

    async def vllm_resume(self, request: web.Request) -> web.Response:
        self._resume()
        return web.json_response({"status": "resumed"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._abort(None if body.get("abort_all") else str(body.get("rid")))
        return web.Response(status=200)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if body.get("weight_version") is not None:
            self.version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self.version = str(body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {self.version}",
                                  "new_version": self.version})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        return web.json_response({"results": [None]})

    async def health_generate(self, request: web.Request) -> web.Response:
        await self._resumed.wait()
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "load-fleet", "is_generation": True, "weight_version": self.version})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1, "max_running_requests": self.script.slots,
                                  "weight_version": self.version})

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def fleet_stats(self, request: web.Request) -> web.Response:
        c = self.shared.counters
        return web.json_response({"tokens": c.tokens, "replies": c.replies, "finished": c.finished, "held": c.held,
                                  "peak_held": c.peak_held, "aborted": c.aborted})

    async def fleet_rate(self, request: web.Request) -> web.Response:
        self.shared.set_rate(float((await _json(request))["rate"]))
        return web.json_response({"rate": self.shared.rate})

    async def fleet_reset(self, request: web.Request) -> web.Response:
        c = self.shared.counters
        c.peak_held = c.held
        return web.json_response({})


def _sglang_finish(reason: str, ran: bool, budget: int, eos_id: int) -> dict[str, Any]:
    """SGLang's finish reasons (managers/schedule_batch.py:284-345: FINISH_MATCHED_TOKEN,
    FINISH_LENGTH, FINISH_ABORT; a request aborted before it ran: "Abort in waiting queue")."""
    if reason == "stop":
        return {"type": "stop", "matched": eos_id}
    if reason == "length":
        return {"type": "length", "length": budget}
    if not ran:
        return {"type": "abort", "message": "Abort in waiting queue"}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def _base(rid: str) -> str:
    """``<rid>-<interruptions>-<resends>`` -> ``<rid>`` (client.py's segment naming); '' if not so named."""
    parts = rid.rsplit("-", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() else ""


def _settle(fut: asyncio.Future, value: str) -> None:
    if not fut.done():
        fut.set_result(value)


async def _json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    return json.loads(raw) if raw else {}


# ---------------------------------------------------------------------- the fleet


class Fleet:
    """``n`` load servers on loopback ports in this process's event loop."""

    def __init__(self, script: Script, n: int, dialect: str = "sglang", longest: int = 32768) -> None:
        self.script, self.n, self.dialect = script, n, dialect
        self.tokens = TokenSource(script, dialect, longest)
        self.shared = _Shared(script.rate)
        self.servers = [LoadServer(script, dialect, self.tokens, self.shared, i) for i in range(n)]
        self.shared.servers = self.servers
        self.urls: list[str] = []
        self._runners: list[web.AppRunner] = []

    async def start(self, host: str = "127.0.0.1") -> "Fleet":
        for server in self.servers:
            runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, host, 0, backlog=4096)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the OS-picked port
            self._runners.append(runner)
            self.urls.append(f"http://{host}:{port}")
        return self

    async def close(self) -> None:
        for server in self.servers:
            server._abort(None)  # noqa: SLF001 - answer what is held so the runners can stop
            server._resume()  # noqa: SLF001
        for runner in self._runners:
            await runner.cleanup()
        self._runners = []

    async def __aenter__(self) -> "Fleet":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


async def _serve(script: Script, n: int, dialect: str, longest: int) -> None:
    fleet = await Fleet(script, n, dialect, longest).start()
    print(json.dumps({"urls": fleet.urls}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin (or dies)
    await fleet.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--script", required=True, help="JSON of a Script (Script.to_dict)")
    ap.add_argument("--servers", type=int, default=36)
    ap.add_argument("--dialect", choices=DIALECTS, default="sglang")
    ap.add_argument("--longest", type=int, default=32768, help="longest answer to pre-encode (tokens)")
    args = ap.parse_args()
    with open(args.script, encoding="utf-8") as fh:
        script = Script.from_dict(json.load(fh))
    asyncio.run(_serve(script, args.servers, args.dialect, args.longest))


if __name__ == "__main__":
    main()

"""The inference client: one async client for SGLang servers and the embedded server.

- pooled aiohttp connections, per-request timeouts, retries with exponential back-off;
- least-load routing: each request goes to the healthy server with the fewest requests
  this client has in flight there;
- a server that refuses connections or times out is taken out of rotation, its requests
  are re-sent elsewhere, and a background health check brings it back when ``/health``
  answers again; never while the servers are paused (:attr:`InferenceClient.servers_paused`):
  SGLang's ``/health`` generates a token, which waits behind the pause and fails;
- a weight update (to servers paused for it) first asks each server whether it is there
  on the dialect's ``liveness_path``, which generates nothing (SGLang: ``/model_info``;
  see :class:`~realscale.inference.dialect.Dialect`), never on ``/health``;
- :meth:`InferenceClient.generate` handles interruption itself: a response with
  ``finish_reason.type == "abort"`` (a pause for a weight update) is resubmitted as
  prompt + partial output with the remaining token budget, and tokens, log-probs and
  per-token policy versions are stitched into one :class:`GenerateResult`;
- a generation past its time limit (:class:`realscale.inference.timeouts.RequestTimeouts`:
  from the token budget and the measured decode rate, or fixed, or none) is aborted on
  its server (``/abort_request`` with its rid); the server answers it with the partial
  output, which is kept, and the rest is resent like an interruption (to another server
  when there is one). Control calls (pause, weight loads, health) keep a fixed limit.

What differs between server APIs (request and reply shapes, the pause and disk-load
calls) is a :class:`~realscale.inference.dialect.Dialect`: SGLang's (also the embedded server's),
vLLM's in :mod:`realscale.inference.vllm_dialect`; :func:`dialect_for` picks one by
``generate.backend``. Routing, retries, retirement and stitching are shared.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterable

import aiohttp
import numpy as np

from realscale.inference.dialect import Dialect, Segment
from realscale.inference.timeouts import RequestTimeouts
from realscale.inference.vllm_dialect import VllmDialect

if TYPE_CHECKING:
    from realscale.inference.weight_sync import WeightPart, WeightSender

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """A server answered with an error (HTTP 4xx/5xx) that retrying will not fix."""


class NoServerError(RuntimeError):
    """Every server is out of rotation."""


class ServerLost(RuntimeError):
    """A weight transfer failed because servers of its group went away mid-way (they are
    retired now); the survivors took part of it: send the whole update again to them."""


CONTROL_TIMEOUT_S = 600.0  # pause / resume / weight loads / health: not generation
ABORT_GRACE_S = 60.0  # how long a server that was told to abort a request may take to answer it
WATCH_S = 5.0  # how often a running generation re-checks its limit (the limit moves as rates are measured)
_NO_LIMIT = -1.0


@dataclasses.dataclass
class GenerateResult:
    """A finished generation, stitched across interruptions."""

    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[Any]  # the policy version that produced each output token
    finish_reason: dict[str, Any]
    text: str = ""
    num_interruptions: int = 0
    num_resends: int = 0  # re-sent after a server failure
    latency: float = 0.0
    num_timeouts: int = 0  # aborted past the time limit (partial output kept, rest resent)
    # with routed experts asked for (routing replay): the experts each position 0 ..
    # len(input_ids) + len(output_ids) - 2 was routed to, flat int32 (positions x layers x
    # top_k), each position's from the request that computed it first (as the log-probs)
    routed_experts: Any = None


def dialect_for(backend: str) -> Dialect:
    """The dialect of ``generate.backend`` (embedded and sglang: SGLang's)."""
    return VllmDialect() if backend == "vllm" else Dialect()


@dataclasses.dataclass
class _Server:
    url: str
    healthy: bool = True
    in_flight: int = 0
    failures: int = 0
    ranks: int = 1  # tensor-parallel ranks: each joins the weight-update group
    # Missed a weight update (did not answer when it was sent): never back in rotation,
    # because it would serve old weights under a version number it does not have.
    retired: bool = False
    # Started again after it died (roster.py): out of rotation until a weight update has
    # reached it (it holds the base model's weights until then).
    pending: bool = False


class InferenceClient:
    """Talks to N generation servers (``http://host:port``)."""

    def __init__(self, urls: Iterable[str], *, request_timeout: float = 0.0, connect_timeout: float = 60.0,
                 max_retries: int = 5, backoff: float = 0.1, health_interval: float = 1.0,
                 max_interruptions: int = 100, per_server: int = 0, dialect: Dialect | None = None,
                 timeout_slack: float = 4.0, control_timeout: float = CONTROL_TIMEOUT_S,
                 routed_experts: bool = False) -> None:
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.routed_experts = routed_experts  # ask for every position's routed experts (routing replay)
        self.dialect = dialect or Dialect()
        self._pause_mode = "abort"  # of the last pause: the dialect's resume may depend on it
        if not self.servers:
            raise ValueError("InferenceClient needs at least one server URL")
        # generation: 0 auto, -1 none, > 0 fixed (realscale/inference/timeouts.py)
        self.timeouts = RequestTimeouts(request_timeout, timeout_slack)
        self.request_timeout = request_timeout if request_timeout > 0 else CONTROL_TIMEOUT_S
        # pause / resume / liveness: one slow server must not hold the cluster (module docstring)
        self.control_timeout = control_timeout
        # The connect timer runs on this (busy) event loop: 9,216 connections opened at once
        # put it 7-10 s behind, and a 5 s limit then retired every server of a 36-server
        # fleet (BENCHMARKS.md, "The rollout tier"). A refused connection still fails at once.
        self.connect_timeout = connect_timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.health_interval = health_interval
        self.max_interruptions = max_interruptions
        # connections (= requests in flight) per server; 0: no cap here. There is no cap on
        # the total: the staleness rule sets how many requests run at once (a fixed pool of
        # 256 capped a 36-server cluster at 3% of its decode slots).
        self.per_server = per_server
        self._in_flight_total = 0
        self._peak_total = self._peak_server = 0  # since the last take_peaks()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._group_urls: list[str] = []  # members of the weight-update group, in rank order
        # The servers are paused (by this client, or for the rollout controller's client by
        # rank 0's server control): no /health probe, which would generate on SGLang.
        self.servers_paused = False
        self._paused_urls: set[str] = set()  # the servers the last pause() reached

    def occupancy(self) -> dict[str, int]:
        """Requests this client has in flight, by server URL."""
        return {s.url: s.in_flight for s in self.servers}

    def take_peaks(self) -> tuple[int, int]:
        """(most requests in flight at once in all, on one server) since the last call. A
        snapshot would miss them: a step is logged just after its weight update, when an
        abort pause has emptied every server and the resubmissions are still on their way."""
        peaks = (self._peak_total, self._peak_server)
        self._peak_total = self._peak_server = 0
        return peaks

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "InferenceClient":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        if self._session is None:
            conn = aiohttp.TCPConnector(limit=0, limit_per_host=self.per_server)
            self._session = aiohttp.ClientSession(connector=conn)
            self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("InferenceClient is not started: use 'async with' or await start()")
        return self._session

    # ------------------------------------------------------------------ transport

    async def _request(self, server: _Server, method: str, path: str, body: Any = None,
                       timeout: float | None = None) -> Any:
        """One HTTP call; connection failures and 5xx raise ``aiohttp.ClientError``/``TimeoutError``."""
        total = None if timeout == _NO_LIMIT else (timeout or self.request_timeout)
        t = aiohttp.ClientTimeout(total=total, sock_connect=self.connect_timeout)
        async with self.session.request(method, server.url + path, json=body, timeout=t) as resp:
            raw = await resp.read()
            if resp.status >= 500:
                raise aiohttp.ClientResponseError(resp.request_info, resp.history, status=resp.status,
                                                  message=raw.decode(errors="replace")[:200])
            if resp.status >= 400:
                raise ServerError(f"{server.url}{path}: HTTP {resp.status}: {raw.decode(errors='replace')[:500]}")
            if not raw:
                return None
            try:
                return await resp.json(content_type=None)
            except ValueError:
                return raw.decode(errors="replace")

    def _pick(self, avoid: set[str]) -> _Server:
        healthy = [s for s in self.servers if s.healthy and s.url not in avoid]
        if not healthy:
            healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            raise NoServerError(f"no healthy server among {[s.url for s in self.servers]}")
        least = min(s.in_flight for s in healthy)
        return random.choice([s for s in healthy if s.in_flight == least])

    def _mark_down(self, server: _Server, exc: BaseException) -> None:
        if server.healthy:
            log.warning("server %s taken out of rotation: %r", server.url, exc)
        server.healthy = False
        server.failures += 1

    async def _routed(self, path: str, body: Any, avoid: set[str] | None = None,
                      generation: tuple[str, int] | None = None) -> tuple[Any, int]:
        """POST to the least-loaded server (not one in ``avoid`` while others are healthy);
        on failure re-send elsewhere. ``generation`` (rid, token budget) puts the call under
        the generation time limit. Returns (reply, resends)."""
        avoid = set(avoid or ())
        for attempt in range(self.max_retries + 1):
            try:
                server = self._pick(avoid)
            except NoServerError:
                if attempt == self.max_retries:
                    raise
                await asyncio.sleep(self.backoff * 2 ** attempt)
                continue
            server.in_flight += 1
            self._in_flight_total += 1
            self._peak_total = max(self._peak_total, self._in_flight_total)
            self._peak_server = max(self._peak_server, server.in_flight)
            try:
                if generation is not None:
                    return await self._generate_on(server, path, body, *generation), attempt
                return await self._request(server, "POST", path, body), attempt
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
                self._mark_down(server, exc)
                avoid.add(server.url)
                await asyncio.sleep(self.backoff * 2 ** attempt * random.uniform(0.5, 1.0))
            finally:
                server.in_flight -= 1
                self._in_flight_total -= 1
        raise NoServerError(f"{path}: gave up after {self.max_retries + 1} attempts")

    async def _generate_on(self, server: _Server, path: str, body: dict[str, Any], rid: str, budget: int) -> Any:
        """One generate call under the time limit. Past it, the request is aborted on its
        server and the server's answer (the partial output, finish reason ``abort``) is
        returned with ``timed_out`` set to the server's URL. A server that does not answer
        the abort (or has no such call: vLLM) raises TimeoutError: the connection is
        dropped, the segment resent from the output kept before it, and the server is out
        of rotation until its next good /health."""
        mark = self.timeouts.mark()
        task = asyncio.ensure_future(self._request(server, "POST", path, body, timeout=_NO_LIMIT))
        try:
            while True:
                limit = self.timeouts.limit(budget)
                left = WATCH_S if limit is None else min(WATCH_S, limit - self.timeouts.active_since(mark))
                if left <= 0:
                    break
                done, _ = await asyncio.wait({task}, timeout=left)
                if task in done:
                    reply = task.result()
                    self._observe(reply, mark)
                    return reply
                if server.retired:  # gone from the run (it missed a pause or an update): resend elsewhere
                    raise asyncio.TimeoutError(f"{server.url} was retired while {rid} ran there")
            log.warning("request %s on %s past its %.0f s limit: aborting it there, keeping its partial output",
                        rid, server.url, limit)
            try:
                for abort_path, abort_body in self.dialect.abort(rid):
                    await self._request(server, "POST", abort_path, abort_body, timeout=ABORT_GRACE_S)
            except ServerError as exc:
                raise asyncio.TimeoutError(f"{server.url} could not abort {rid}: {exc}") from exc
            reply = await asyncio.wait_for(asyncio.shield(task), ABORT_GRACE_S)
            self._observe(reply, mark)
            return {**reply, "timed_out": server.url}
        finally:
            if not task.done():
                # Let the HTTP call finish cancelling now (its connection closes, which ends
                # the request on the server) rather than after this loop may have stopped.
                task.cancel()
                try:
                    await asyncio.wait({task}, timeout=5)
                except BaseException:  # noqa: BLE001 - a second cancellation: the first one goes on
                    pass

    def _observe(self, reply: Any, mark: tuple[float, float]) -> None:
        """The decode rate of a finished request, for the auto limit."""
        try:
            tokens = len(self.dialect.parse_generate(reply).ids)
        except (KeyError, TypeError, ValueError, IndexError):
            return  # an unexpected reply shape: the caller reports it; no measurement
        self.timeouts.observe(tokens, self.timeouts.active_since(mark))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            if self.servers_paused:
                continue  # SGLang's /health would wait behind the pause, then fail (module docstring)
            for server in [s for s in self.servers if not s.healthy and not s.retired and not s.pending]:
                if await self._probe(server):
                    log.info("server %s back in rotation", server.url)
                    server.healthy = True

    async def _probe(self, server: _Server) -> bool:
        try:
            await self._request(server, "GET", "/health", timeout=min(5.0, self.request_timeout))
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ServerError):
            return False

    async def _alive(self, server: _Server) -> bool:
        """Whether ``server`` is still there, asked on the dialect's ``liveness_path`` (no
        generation: the servers are paused for a weight update). A refused connection
        (nobody listens on the port) or a 5xx answer, a few times in a row, means it is
        gone; a slow answer does not: on a loaded machine a live server can take many
        seconds to answer, and retiring it would cost the run a healthy server, so slow
        ones are waited for up to ``control_timeout``."""
        deadline = time.monotonic() + self.control_timeout
        refusals = 0
        while True:
            try:
                await self._request(server, "GET", self.dialect.liveness_path, timeout=min(10.0, self.control_timeout))
                return True
            except (aiohttp.ClientConnectorError, aiohttp.ClientResponseError, ServerError):
                refusals += 1
                if refusals > self.max_retries:
                    return False
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
                if time.monotonic() > deadline:
                    return False
            await asyncio.sleep(self.backoff * 2 ** min(refusals, 5))

    async def _update_targets(self) -> list[_Server]:
        """The servers a weight update goes to: every server not retired that answers on the
        dialect's liveness path now (also ones out of rotation after a failed request: they
        come back with the new weights). One that does not answer is retired for good."""
        candidates = [s for s in self.servers if not s.retired]
        alive = await asyncio.gather(*(self._alive(s) for s in candidates))
        targets = []
        for server, ok in zip(candidates, alive):
            if ok:
                server.healthy = not server.pending  # a new one serves once the update reached it
                targets.append(server)
            else:
                log.warning("server %s does not answer %s; retired (it misses this weight update)", server.url,
                            self.dialect.liveness_path)
                server.retired, server.healthy = True, False
        if not targets:
            raise NoServerError(f"no generation server answers {self.dialect.liveness_path} for the weight update: "
                                f"{[s.url for s in self.servers]}")
        return targets

    # ------------------------------------------------------------------ API

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None,
                       rid: str | None = None) -> GenerateResult:
        """Generate to completion, resubmitting after pauses; stitched result."""
        params = dict(sampling_params or {})
        budget = int(params.get("max_new_tokens", 128))
        start = time.monotonic()
        rid = rid or uuid.uuid4().hex
        out_ids: list[int] = []
        out_lps: list[float] = []
        out_versions: list[Any] = []
        interruptions = resends = timeouts = 0
        avoid: set[str] = set()
        text = ""
        routing: list[Any] = []  # flat int32 pieces, in position order
        held = 0  # positions whose routing is held
        while True:
            params["max_new_tokens"] = budget - len(out_ids)
            # a continuation asks only for the positions not held yet: those computed before
            # an interruption keep the routing that produced the tokens sampled after them
            body = self.dialect.generate_body(list(input_ids) + out_ids, params, f"{rid}-{interruptions}-{resends}",
                                              routing_from=held if self.routed_experts else None)
            reply, tries = await self._routed(self.dialect.generate_path, body, avoid,
                                              generation=(f"{rid}-{interruptions}-{resends}", budget - len(out_ids)))
            resends += tries
            slow = reply.pop("timed_out", None)
            timeouts += slow is not None
            avoid = {slow} if slow else set()  # the rest goes elsewhere when another server is healthy
            seg = self.dialect.parse_generate(reply)
            text += seg.text
            out_ids += seg.ids
            out_lps += seg.logprobs
            out_versions += seg.versions
            if self.routed_experts:
                held = self._take_routing(seg, routing, held, len(input_ids) + len(out_ids) - 1, rid)
            reason = seg.finish_reason
            if reason.get("type") != "abort" or len(out_ids) >= budget:
                break
            interruptions += 1
            if interruptions > self.max_interruptions:
                raise ServerError(f"request {rid} was interrupted {interruptions} times; giving up")
        if len(out_ids) >= budget and reason.get("type") in ("abort", "length"):
            reason = {"type": "length", "length": budget}  # the whole budget, not the last segment's
        return GenerateResult(input_ids=list(input_ids), output_ids=out_ids, output_logprobs=out_lps,
                              output_versions=out_versions, finish_reason=reason, text=text,
                              num_interruptions=interruptions, num_resends=resends,
                              latency=time.monotonic() - start, num_timeouts=timeouts,
                              routed_experts=np.concatenate(routing) if self.routed_experts and routing else None)

    @staticmethod
    def _take_routing(seg: Segment, routing: list[Any], held: int, fed: int, rid: str) -> int:
        """Append a reply's routed experts (positions ``held`` .. ``fed - 1``: every position
        fed to the model; the last sampled token never is) and return the positions held.
        A reply with no routing for positions that ran is an error, not a gap."""
        rows = fed - held
        got = seg.routed_experts
        if rows <= 0:
            return held
        if got is None or got.size == 0:
            if seg.ids:
                raise ServerError(f"request {rid}: the server returned no routed experts (routing replay needs "
                                  "a mixture-of-experts model and a server that reports its routing)")
            return held  # aborted before it ran: asked for again by the continuation
        if got.size % rows:
            raise ServerError(f"request {rid}: {got.size} routed-expert ids do not divide into the {rows} positions "
                              f"{held}..{fed - 1}")
        routing.append(got)
        return fed

    async def _control(self, path: str, body: dict[str, Any], also: set[str] | frozenset[str] = frozenset(),
                       retire_slow: bool = False) -> None:
        """POST to every server in rotation (and those in ``also`` not retired), each within
        ``control_timeout``; one that cannot be reached is taken out of rotation (a dead
        server must not stop the others from pausing or resuming). ``retire_slow`` (a pause):
        one that does not answer in time is retired, since it may still be generating with
        the weights the update replaces; the launcher starts it again."""
        targets = [s for s in self.servers if s.healthy or (s.url in also and not s.retired)]
        results = await asyncio.gather(*(self._request(s, "POST", path, body, timeout=self.control_timeout)
                                         for s in targets), return_exceptions=True)
        for server, res in zip(targets, results):
            if isinstance(res, asyncio.TimeoutError) and retire_slow:
                log.warning("server %s did not answer %s within %.0f s (generate.control_timeout_s); retired",
                            server.url, path, self.control_timeout)
                server.retired, server.healthy = True, False
            elif isinstance(res, (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)):
                self._mark_down(server, res)
            elif isinstance(res, BaseException):
                raise res

    async def pause(self, mode: str = "abort") -> None:
        self._pause_mode = mode
        self.servers_paused = True
        self._paused_urls = {s.url for s in self.servers if s.healthy}
        self.timeouts.pause()  # held requests do not run out of time while the servers are paused
        for path, body in self.dialect.pause(mode):
            await self._control(path, body, retire_slow=True)

    async def resume(self) -> None:
        """Resume every server this client paused, also one taken out of rotation since
        (a failed request during the pause): a paused server never passes the health check
        that would bring it back (SGLang's /health generates)."""
        for path, body in self.dialect.resume(self._pause_mode):
            await self._control(path, body, also=self._paused_urls)
        self._paused_urls = set()
        self.timeouts.resume()
        self.servers_paused = False

    def add_server(self, url: str, ranks: int = 1, pending: bool = True) -> bool:
        """A server started after this client (a restart: :mod:`realscale.inference.roster`).
        ``pending``: it joins the next weight update but serves no request before
        :meth:`admit_pending`; else it is in rotation at once (it holds the current weights).
        A retired server of the same URL is replaced; one still known is left as it is.
        Returns whether the server was added."""
        url = url.rstrip("/")
        known = next((i for i, s in enumerate(self.servers) if s.url == url), None)
        if known is not None and not self.servers[known].retired:
            return False
        server = _Server(url, healthy=not pending, ranks=ranks, pending=pending)
        if known is None:
            self.servers.append(server)
        else:
            self.servers[known] = server
        return True

    def admit_pending(self) -> list[str]:
        """Put the pending servers a weight update has reached (they are its targets: not
        retired) in rotation; their URLs."""
        admitted = [s for s in self.servers if s.pending and not s.retired]
        for s in admitted:
            s.pending, s.healthy = False, True
        return [s.url for s in admitted]

    async def update_weights_from_disk(self, path: str, weight_version: Any = None,
                                       flush_cache: bool = True) -> list[Any]:
        """Every server loads ``path``; ``flush_cache`` as SGLang's field (the pinned SGLang
        fails the call when it cannot flush because requests still hold KV). The calls are
        the dialect's (vLLM: ``reload_weights``; its KV follows the pause mode instead)."""
        calls = self.dialect.load_from_disk(path, weight_version, flush_cache)
        targets = await self._update_targets()

        async def load(server: _Server) -> Any:
            reply = None
            for call_path, body in calls:
                reply = await self._request(server, "POST", call_path, body)
            return reply

        return list(await asyncio.gather(*(load(s) for s in targets)))

    async def update_targets(self) -> list[str]:
        """URLs of the servers the next weight update goes to (module docstring: the dead
        are retired first)."""
        return [s.url for s in await self._update_targets()]

    async def post(self, url: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """One control call to the server at ``url`` (weight-transfer handshakes)."""
        server = next((s for s in self.servers if s.url == url.rstrip("/")), None)
        if server is None:
            raise ValueError(f"{url} is not one of this client's servers {[s.url for s in self.servers]}")
        return await self._request(server, "POST", path, body, timeout=timeout)

    async def _server_ranks(self, servers: list[_Server], ranks: dict[str, int] | None) -> None:
        """Each server's rank count: from ``ranks`` ({url: ranks}) or its ``/get_server_info``
        ``tp_size`` (SGLang's key)."""
        given = {u.rstrip("/"): n for u, n in (ranks or {}).items()}
        for server in servers:
            if server.url in given:
                server.ranks = int(given[server.url])
            else:
                info = await self._request(server, "GET", "/get_server_info")
                server.ranks = int(info.get("tp_size", 1)) if isinstance(info, dict) else 1

    async def init_weights_update_group(self, sender: WeightSender, ranks: dict[str, int] | None = None) -> None:
        """Join every rank of every server to ``sender``'s group while the sender hosts rank 0:
        server i's tensor-parallel rank r joins at ``rank_offset_i + r``, with rank_offset_0 = 1
        and each next server after the last rank of the previous one. ``ranks`` = {url: number
        of ranks}; a server not in it is asked (``/get_server_info``). A server that is gone
        already is retired first, and the group is hosted for the others."""
        given = {u.rstrip("/"): int(n) for u, n in (ranks or {}).items()}
        known = [s for s in self.servers if not s.retired]
        if all(s.url in given for s in known) and sender.world_size != 1 + sum(given[s.url] for s in known):
            raise ValueError(f"sender.world_size={sender.world_size}, but the servers have "
                             f"{sum(given[s.url] for s in known)} ranks + 1 trainer rank")
        targets = await self._update_targets()
        await self._server_ranks(targets, ranks)
        world = 1 + sum(s.ranks for s in targets)
        if sender.world_size != world:  # it counted servers that are gone
            sender.reopen(world_size=world)
        await self._join_group(sender, targets)

    @staticmethod
    def _rank_offsets(targets: list[_Server]) -> list[int]:
        offsets, nxt = [], 1
        for s in targets:
            offsets.append(nxt)
            nxt += s.ranks
        return offsets

    async def _join_group(self, sender: WeightSender, targets: list[_Server]) -> None:
        loop = asyncio.get_running_loop()
        posts = [self._request(s, "POST", "/init_weights_update_group", sender.init_request(offset))
                 for s, offset in zip(targets, self._rank_offsets(targets))]
        await asyncio.gather(loop.run_in_executor(None, sender.connect), *posts)
        self._group_urls = [s.url for s in targets]

    async def _regroup(self, sender: WeightSender, targets: list[_Server]) -> None:
        """A member of the weight-update group is gone, and a collective with a dead member
        never completes: rebuild the group among ``targets`` on a fresh port."""
        log.warning("weight-update group %s -> %s: rebuilding it", self._group_urls, [s.url for s in targets])
        await self._leave_group(sender, targets)
        sender.reopen(world_size=1 + sum(s.ranks for s in targets))
        await self._join_group(sender, targets)

    async def join_groups(self, senders: list[Any], ranks: dict[str, int], leaving: Iterable[str] = ()) -> None:
        """Several weight groups at once (one per trainer pipeline stage): the servers at
        ``leaving`` first leave every sender's group (a previous membership: SGLang refuses
        a group name it holds), then the servers in ``ranks`` ({url: ranks}, in rank order)
        join each sender's group, one group after another — a server joins one group at a
        time, so every server must be asked in the same order. A sender here hosts its group
        while its servers join (``connect``); another process's (``RemoteSender``) hosts
        its own."""
        by_url = {s.url: s for s in self.servers}
        unknown = sorted(set(ranks) - set(by_url))
        if unknown:
            raise ValueError(f"join_groups: not servers of this client: {unknown}")
        gone = [by_url[u] for u in leaving if u in by_url]
        for sender in senders:
            await self._leave_group(sender, gone)
        targets = [by_url[u] for u in ranks]
        await self._server_ranks(targets, ranks)
        for sender in senders:
            await self._join_group(sender, targets)

    async def leave_groups(self, senders: list[Any], urls: list[str]) -> None:
        """The servers at ``urls`` leave every sender's group (the trainer is done with them)."""
        targets = [s for s in self.servers if s.url in set(urls) and not s.retired]
        for sender in senders:
            await self._leave_group(sender, targets)

    async def destroy_weights_update_group(self, sender: WeightSender) -> None:
        """Take the group's servers out of it (the trainer is done with it): SGLang keeps a
        group until told, and refuses a later ``/init_weights_update_group`` of the same
        name (``init_custom_process_group``: "The specified group name has already been
        created"), so a next trainer on the same servers could not join them."""
        members = [s for s in self.servers if s.url in self._group_urls and s.healthy and not s.retired]
        await self._leave_group(sender, members)
        self._group_urls = []

    async def _leave_group(self, sender: WeightSender, targets: list[_Server]) -> None:
        for s in targets:
            try:
                await self._request(s, "POST", "/destroy_weights_update_group", {"group_name": sender.group_name})
            except ServerError:
                pass  # never joined it, or gone

    async def retire_dead(self, urls: list[str]) -> list[str]:
        """After a failed weight transfer: which of these servers are gone (their liveness
        path refuses or errs); they are retired. A live one, slow or not, stays."""
        servers = [s for s in self.servers if s.url in set(urls) and not s.retired]
        alive = await asyncio.gather(*(self._alive(s) for s in servers))
        dead = [s for s, ok in zip(servers, alive) if not ok]
        for s in dead:
            log.warning("server %s went away during a weight transfer; retired", s.url)
            s.retired, s.healthy = True, False
        return [s.url for s in dead]

    async def _post_all(self, targets: list[_Server], path: str, body: dict[str, Any]) -> list[Any]:
        return list(await asyncio.gather(*(self._request(s, "POST", path, body) for s in targets)))

    async def update_weights(self, sender: WeightSender, buckets: Iterable[list[tuple[str, Any]]],
                             weight_version: Any = None, flush_cache: bool = True, count: int | None = None) -> int:
        """Stream ``buckets`` through ``sender`` into every server; returns bytes sent.

        SGLang's session: ``/begin_weight_update``; per bucket ``/update_weights_from_distributed``
        while the sender broadcasts; ``/end_weight_update`` (also after a failure, so the
        servers are not left inside a session). The version and the cache flush go with the
        last bucket only, so no token is tagged with a version whose weights are partly
        loaded, and the cache is flushed once. ``count``: the number of buckets, when known
        (then each next bucket is exported while one is sent).
        """
        from realscale.inference.weight_sync import WeightPart  # torch: not loaded by the client itself

        targets = await self._update_targets()
        if [s.url for s in targets] != self._group_urls:
            await self._regroup(sender, targets)
        return await self._update_session(targets, [WeightPart(sender, buckets, count)], weight_version, flush_cache)

    async def update_weights_in_parts(self, parts: list["WeightPart"], urls: list[str], weight_version: Any = None,
                                      flush_cache: bool = True) -> int:
        """One update session over several weight groups, each ``part`` broadcast by its
        own sender (a pipeline stage's group; its broadcasts may run in another process:
        ``part.sender`` then only names the group), in order, into the servers at ``urls``
        (every part's group holds exactly those, in that order: the caller keeps it so).
        A server takes one update call at a time, so the parts are posted one after
        another, the same order at every server. The version and the flush go with the
        last bucket of the last part. Returns the bytes this process's senders sent."""
        by_url = {s.url: s for s in self.servers}
        unknown = [u for u in urls if u not in by_url]
        if unknown:
            raise ValueError(f"update_weights_in_parts: not servers of this client: {unknown}")
        return await self._update_session([by_url[u] for u in urls], parts, weight_version, flush_cache)

    async def _update_session(self, targets: list[_Server], parts: list["WeightPart"], weight_version: Any,
                              flush_cache: bool) -> int:
        await self._post_all(targets, "/begin_weight_update", {})
        try:
            sent = 0
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                sent += await self._send_buckets(part, targets, weight_version if last else None, flush_cache and last)
        except BaseException as failure:
            gone = await self.retire_dead([s.url for s in targets]) if isinstance(failure, Exception) else []
            alive = [s for s in targets if s.url not in gone]
            try:
                await self._post_all(alive, "/end_weight_update", {})
            except Exception as exc:  # noqa: BLE001 - the first failure is the one to report
                log.warning("end_weight_update after a failed update: %r", exc)
            if len(alive) < len(targets):
                raise ServerLost(f"weight update to {[s.url for s in targets]}: "
                                 f"{sorted({s.url for s in targets} - {s.url for s in alive})} went away mid-way "
                                 f"({failure!r})") from failure
            raise
        await self._post_all(targets, "/end_weight_update", {})
        return sent

    async def _send_buckets(self, part: "WeightPart", targets: list[_Server], weight_version: Any,
                            flush_cache: bool) -> int:
        """The buckets of one part; returns bytes sent.

        With ``part.count`` known, the next bucket is exported (its TP gathers, its cast)
        while this one is broadcast; without it, the next is taken first (the version and
        the flush must ride on the last bucket's request)."""
        from realscale.inference.weight_sync import bucket_meta

        loop = asyncio.get_running_loop()
        sender, it = part.sender, iter(part.buckets)
        bucket = next(it, None)
        if bucket is None and weight_version is not None:  # nothing to send: only the version moves
            await self._post_all(targets, "/update_weight_version",
                                 {"new_version": str(weight_version), "abort_all_requests": False})
        sent, index = 0, 0
        while bucket is not None:
            following: Any = None
            if part.count is None:
                following = next(it, None)
                last = following is None
            else:
                last = index == part.count - 1
            body: dict[str, Any] = {**bucket_meta(bucket), "group_name": sender.group_name,
                                    "flush_cache": flush_cache and last}
            if last and weight_version is not None:
                body["weight_version"] = str(weight_version)
            posts = [asyncio.ensure_future(self._request(s, "POST", "/update_weights_from_distributed", body))
                     for s in targets]
            # every part ends (or fails) before this returns: no broadcast left running on a
            # group that a resend will rebuild
            broadcast = loop.run_in_executor(None, sender.broadcast_bucket, bucket)
            if part.count is not None:
                following = await loop.run_in_executor(None, next, it, None)  # while it is sent
            try:
                sent += await broadcast
            except Exception:
                # A member went away mid-bucket. Drop the group now: the survivors' receives
                # then fail at once ("connection closed") instead of at the group's timeout.
                sender.close()
                await asyncio.gather(*posts, return_exceptions=True)
                raise
            errors = [r for r in await asyncio.gather(*posts, return_exceptions=True) if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            if part.count is not None and (following is None) != last:
                raise RuntimeError(f"weight group {sender.group_name!r}: the export gave a different number of "
                                   f"buckets than its metadata said ({part.count})")
            bucket, index = following, index + 1
        return sent

    # ------------------------------------------------------------------ weight world (ReshardTransport)

    async def weight_targets(self) -> list[str]:
        """URLs of the servers a weight update goes to, in server order: every one not
        retired that answers on the liveness path now (one that does not is retired for good)."""
        return [s.url for s in await self._update_targets()]

    async def post_each(self, path: str, bodies: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """POST ``bodies[url]`` to each of those servers at once; their replies by URL."""
        by_url = {s.url: s for s in self.servers}
        unknown = sorted(set(bodies) - set(by_url))
        if unknown:
            raise ValueError(f"{path}: not servers of this client: {unknown}")
        urls = list(bodies)
        replies = await asyncio.gather(*(self._request(by_url[u], "POST", path, bodies[u]) for u in urls))
        return dict(zip(urls, replies))

    async def health(self) -> dict[str, bool]:
        """Probe every server's ``/health`` now; updates rotation; returns ``{url: healthy}``.
        Not while the servers are paused: on SGLang that probe generates, so it waits
        behind the pause and fails (module docstring)."""
        oks = await asyncio.gather(*(self._probe(s) for s in self.servers))
        for s, ok in zip(self.servers, oks):
            s.healthy = ok and not s.pending
        return {s.url: s.healthy for s in self.servers}

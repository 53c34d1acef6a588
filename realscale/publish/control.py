"""Rank 0's handle on the generation servers: :class:`ServerControl` (an HTTP client on an
event loop of its own, and the rollout controller's pause / version / resume)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from realscale.inference.client import InferenceClient


@dataclass(frozen=True)
class ServerEndpoint:
    """One generation server: its URL and how many ranks (tensor-parallel workers) it has.
    Every rank of a server joins the weight groups it is told to join."""

    url: str
    ranks: int = 1


Coro = Callable[["InferenceClient"], Awaitable[Any]]


class RolloutSide(Protocol):
    """What server control needs of the rollout controller (in its own process or not:
    :mod:`realscale.rollout.process`)."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def retire(self, urls: list[str]) -> None: ...


class ServerControl:
    """Rank 0's handle on the servers: an HTTP client of its own, on an event loop of its
    own (a thread of rank 0, busy only while a weight update runs), and the rollout
    controller's pause / version / resume. The controller generates with its own client
    (in its own process): ``fn(client)`` coroutines here never cross a process boundary,
    so a transport may pass them live objects (a weight sender, a bucket iterator whose
    exports are collectives of the trainer ranks). Servers a weight update retires (they
    did not answer) are handed to the controller before generation resumes."""

    def __init__(self, rollouts: RolloutSide, servers: list[ServerEndpoint],
                 client: Callable[[], "InferenceClient"]) -> None:
        self.rollouts = rollouts
        self.servers = servers
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="server-control", daemon=True)
        self._thread.start()
        self.client = client()
        self._on_loop(self.client.start()).result(60.0)

    def _on_loop(self, coro: Awaitable[Any]) -> "Future[Any]":
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, fn: Coro, timeout: float | None = 600.0) -> Any:
        """``await fn(client)`` on the control loop; wait for the result."""
        return self.submit(fn).result(timeout)

    def submit(self, fn: Coro) -> "Future[Any]":
        """``await fn(client)`` on the control loop; return at once (a future)."""
        return self._on_loop(_await(fn, self.client))

    def pause(self, mode: str) -> None:
        self.rollouts.pause()
        self.run(lambda c: c.pause(mode))

    def resume(self, version: int) -> None:
        retired = [s.url for s in self.client.servers if s.retired]
        if retired:
            self.rollouts.retire(retired)
        self.rollouts.set_version(version)
        self.run(lambda c: c.resume())
        self.rollouts.resume()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._on_loop(self.client.close()).result(30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30.0)
            if not self._thread.is_alive():
                self._loop.close()


async def _await(fn: Coro, client: "InferenceClient") -> Any:
    return await fn(client)


class _NoRollouts:
    """The rollout side of a :class:`ClientControl`: there is none."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def retire(self, urls: list[str]) -> None: ...


class ClientControl(ServerControl):
    """A :class:`ServerControl` with no rollout controller: an
    :class:`~realscale.inference.client.InferenceClient` on a loop thread of its own
    (benchmarks and tests drive transports through it exactly as the trainer does)."""

    def __init__(self, servers: list[ServerEndpoint], request_timeout: float = 600.0) -> None:
        urls = [s.url for s in servers]
        super().__init__(_NoRollouts(), servers, lambda: InferenceClient(urls, request_timeout=request_timeout))

"""Rank 0's handle on the generation servers: :class:`ServerControl` (an HTTP client on an
event loop of its own, and the rollout controller's pause / version / resume)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from realscale.inference.client import InferenceClient, NoServerError
from realscale.inference.roster import read_roster, report_retired


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
    def admit(self, urls: list[str]) -> None: ...


class ServerControl:
    """Rank 0's handle on the servers: an HTTP client of its own, on an event loop of its
    own (a thread of rank 0, busy only while a weight update runs), and the rollout
    controller's pause / version / resume. The controller generates with its own client
    (in its own process): ``fn(client)`` coroutines here never cross a process boundary,
    so a transport may pass them live objects (a weight sender, a bucket iterator whose
    exports are collectives of the trainer ranks). Servers a weight update retires (they
    did not answer) are handed to the controller before generation resumes.

    Restarted servers: before each pause, the launcher's roster (``roster``, the path of
    :mod:`realscale.inference.roster`) is read; a URL not known yet is added to the client
    as pending, so that the weight update goes to it too (the transports rebuild their
    group or world when its members change), and once the update is done it is handed to
    the controller (``admit``) to generate. Servers an update retired are reported to the
    launcher beside the roster (one still running is ended and started again)."""

    def __init__(self, rollouts: RolloutSide, servers: list[ServerEndpoint],
                 client: Callable[[], "InferenceClient"], roster: str | None = None,
                 ranks_per_server: int = 1) -> None:
        self.rollouts = rollouts
        self.servers = servers
        self.roster = roster
        self.ranks_per_server = ranks_per_server
        self._reported: set[str] = set()  # retired servers the launcher was told of
        self._serving = {s.url.rstrip("/") for s in servers}  # servers the rollouts were given (to retire)
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
        self._take_restarted()
        self.rollouts.pause()
        self.run(lambda c: c.pause(mode))

    def _take_restarted(self) -> None:
        """Servers the launcher started again since the last look: pending in the client,
        and endpoints of the transports' groups."""
        if self.roster is None:
            return
        urls = [entry.url for entry in read_roster(self.roster)]
        for url in self.run(_adder(urls, self.ranks_per_server)):  # one call on the client's loop for all
            self.servers.append(ServerEndpoint(url, self.ranks_per_server))

    def reachable(self) -> bool:
        """Whether some server (in rotation, or restarted and pending) answers for the weight
        update now; the ones that do not are retired (as the update itself would)."""
        return self.run(_reachable)

    def known(self) -> list[str]:
        """URLs of every server a weight update went to or will go to, retired ones too:
        a roster URL not among them is a restarted server no update has reached yet (a
        restarted server always has a new URL: the launchers pick another port)."""
        return self.run(_known, 60.0)

    def resume(self, version: int) -> None:
        retired = [s.url for s in self.client.servers if s.retired]
        given = [u for u in retired if u in self._serving]  # not a restarted one that died before it served
        if given:
            self.rollouts.retire(given)
        if self.roster is not None and set(retired) - self._reported:
            report_retired(self.roster, sorted(set(retired) - self._reported))  # the launcher restarts them
            self._reported.update(retired)
        self.rollouts.set_version(version)
        self.run(lambda c: c.resume())
        admitted = self.run(_admit_pending)  # the update reached them: they hold this version
        if admitted:
            self.rollouts.admit(admitted)
            self._serving.update(admitted)
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


def _adder(urls: list[str], ranks: int) -> Coro:
    """Add the servers the client does not know yet, as pending; the URLs added."""
    async def add(client: "InferenceClient") -> list[str]:  # on the client's loop, like every other call
        return [u.rstrip("/") for u in urls if client.add_server(u, ranks, pending=True)]
    return add


async def _reachable(client: "InferenceClient") -> bool:
    try:
        await client.update_targets()
    except NoServerError:
        return False
    return True


async def _known(client: "InferenceClient") -> list[str]:
    return [s.url for s in client.servers]


async def _admit_pending(client: "InferenceClient") -> list[str]:
    return client.admit_pending()


class _NoRollouts:
    """The rollout side of a :class:`ClientControl`: there is none."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def retire(self, urls: list[str]) -> None: ...
    def admit(self, urls: list[str]) -> None: ...


class ClientControl(ServerControl):
    """A :class:`ServerControl` with no rollout controller: an
    :class:`~realscale.inference.client.InferenceClient` on a loop thread of its own
    (benchmarks and tests drive transports through it exactly as the trainer does)."""

    def __init__(self, servers: list[ServerEndpoint], request_timeout: float = 600.0) -> None:
        urls = [s.url for s in servers]
        super().__init__(_NoRollouts(), servers, lambda: InferenceClient(urls, request_timeout=request_timeout))

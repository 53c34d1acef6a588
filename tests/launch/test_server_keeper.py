"""The parts of server restarts that need no server: the keeper's decisions (with a
backend stand-in that records what it was asked), the roster, and the client's pending
servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from realscale.config import ConfigError, GenerateConfig, LaunchConfig
from realscale.inference.client import InferenceClient, NoServerError
from realscale.inference.roster import read_roster, report_retired, roster_path
from realscale.launcher.restart import ServerKeeper


class Backend:
    """Servers as exit codes; a respawn gives server i a new URL that is ready at once."""

    def __init__(self, n: int) -> None:
        self.codes: list[int | None] = [None] * n
        self.respawned: list[int] = []

    def server_exit_code(self, i: int) -> int | None:
        return self.codes[i]

    def respawn_server(self, i: int) -> None:
        self.respawned.append(i)
        self.codes[i] = None

    def server_ready(self, i: int) -> str:
        return f"http://h:{9000 + 10 * len(self.respawned) + i}"


def _settle(keeper: ServerKeeper) -> None:
    for slot in keeper.slots:
        if slot.starting is not None:
            slot.starting.join(10)


def test_dead_server_is_started_again_within_its_limit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    backend = Backend(2)
    keeper = ServerKeeper(str(tmp_path), ["http://h:1", "http://h:2"], 1, backend)
    assert [(e.url, e.restarts) for e in read_roster(roster_path(str(tmp_path)))] == [("http://h:1", 0), ("http://h:2", 0)]
    keeper.check()
    assert backend.respawned == []  # both running
    backend.codes[1] = -9
    keeper.check()
    _settle(keeper)
    assert backend.respawned == [1]
    roster = read_roster(roster_path(str(tmp_path)))
    assert [(e.index, e.url, e.restarts) for e in roster] == [(0, "http://h:1", 0), (1, "http://h:9011", 1)]
    backend.codes[1] = 1  # dies again: the limit (1) is used
    keeper.check()
    keeper.check()
    assert backend.respawned == [1]
    out = capsys.readouterr().out
    assert "exited with code -9; starting it again (1 of launch.server_restarts=1)" in out
    assert out.count("not started again (launch.server_restarts=1 used)") == 1
    # the roster says so: trainer rank 0 stops waiting for it (realscale/publish/outage.py)
    assert [e.given_up for e in read_roster(roster_path(str(tmp_path)))] == [False, True]


def test_server_the_trainer_retired_is_ended_and_started_again(tmp_path: Path) -> None:
    backend = Backend(2)
    keeper = ServerKeeper(str(tmp_path), ["http://h:1", "http://h:2"], 3, backend)
    report_retired(roster_path(str(tmp_path)), ["http://h:1"])  # running, but it missed a pause
    keeper.check()
    _settle(keeper)
    assert backend.respawned == [0]
    keeper.check()  # the new server's URL was never retired: left alone
    assert backend.respawned == [0] and [e.restarts for e in read_roster(roster_path(str(tmp_path)))] == [1, 0]


def test_pending_server_joins_updates_but_serves_after_admission() -> None:
    client = InferenceClient(["http://h:1"])
    client.servers[0].retired, client.servers[0].healthy = True, False
    assert client.add_server("http://h:2", ranks=2)
    assert not client.add_server("http://h:2")  # known and not retired: left as it is
    assert client.add_server("http://h:1/")  # a retired URL is replaced by the new server
    assert [(s.url, s.pending, s.healthy, s.ranks) for s in client.servers] == [
        ("http://h:1", True, False, 1), ("http://h:2", True, False, 2)]
    with pytest.raises(NoServerError):
        client._pick(set())  # nothing serves before a weight update reached it
    assert client.admit_pending() == ["http://h:1", "http://h:2"]
    assert client._pick(set()).url in ("http://h:1", "http://h:2")


def test_restart_knobs_are_checked() -> None:
    with pytest.raises(ConfigError, match="launch.server_restarts"):
        LaunchConfig(server_restarts=-1)
    with pytest.raises(ConfigError, match="generate.control_timeout_s"):
        GenerateConfig(control_timeout_s=0)


def test_server_that_does_not_answer_a_pause_is_retired_in_time() -> None:
    """One server answers its pause, the other hangs: the pause returns after
    ``control_timeout`` with the hung one retired (it may still be generating on the old
    weights), not after the control calls' 600 s."""

    async def paused(request: web.Request) -> web.Response:
        return web.json_response({})

    async def hangs(request: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.json_response({})

    async def go() -> tuple[float, list[tuple[bool, bool]]]:
        servers = []
        for handler in (paused, hangs):
            app = web.Application()
            app.router.add_post("/pause_generation", handler)
            servers.append(TestServer(app))
            await servers[-1].start_server()
        try:
            async with InferenceClient([str(s.make_url("")) for s in servers], control_timeout=0.5) as client:
                t0 = asyncio.get_running_loop().time()
                await client.pause("abort")
                return asyncio.get_running_loop().time() - t0, [(s.retired, s.healthy) for s in client.servers]
        finally:
            for s in servers:
                await s.close()

    took, state = asyncio.run(go())
    assert state == [(False, True), (True, False)]
    assert took < 10

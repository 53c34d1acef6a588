"""Every generation server down at once (realscale/publish/outage.py): when trainer rank 0
republishes the current weights to restarted servers, waits for the launcher, or fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from realscale.inference.roster import RosterEntry, roster_path, write_roster
from realscale.publish.outage import FAIL, NONE, REPUBLISH, WAIT, OutageWatch, ServersGone, decide

A, B, A2, B2 = "http://h:1", "http://h:2", "http://h:11", "http://h:12"


def test_a_server_in_rotation_in_every_shard_is_no_outage() -> None:
    roster = [RosterEntry(0, A2, 1), RosterEntry(1, B)]
    assert decide([[B]], roster, {A, B}, 100.0).action == NONE  # A2 pending: it joins the next update as usual
    assert decide([[A], [B]], roster, {A, B}, 100.0).action == NONE


def test_restarted_servers_get_the_weights_when_none_is_in_rotation() -> None:
    roster = [RosterEntry(0, A2, 1), RosterEntry(1, B, 0)]  # A died and is back on a new port; B is dead too
    verdict = decide([[]], roster, {A, B}, 0.0)
    assert verdict.action == REPUBLISH and verdict.pending == (A2,)
    # one rollout shard of two without a server: the same
    assert decide([[B], []], roster, {A, B}, 0.0).action == REPUBLISH


def test_dead_servers_the_launcher_may_restart_are_waited_for() -> None:
    roster = [RosterEntry(0, A, 1), RosterEntry(1, B, 3, given_up=True)]
    verdict = decide([[]], roster, {A, B}, 1e6)  # however long: A's restart may still come
    assert verdict.action == WAIT and "server 0 (http://h:1" in verdict.message
    # a shard without servers while the other shard's server lives: only a dead one may come back
    live_elsewhere = [RosterEntry(0, A, 3, given_up=True), RosterEntry(1, B, 0)]
    assert decide([[], [B]], live_elsewhere, {A, B}, 1.0).action == WAIT  # within the grace
    assert decide([[], [B]], live_elsewhere, {A, B}, 60.0).action == FAIL


def test_nothing_can_come_back_fails_after_the_grace_with_one_line(tmp_path: Path) -> None:
    roster = [RosterEntry(0, A, 3, given_up=True), RosterEntry(1, B, 3, given_up=True)]
    assert decide([[]], roster, {A, B}, 5.0, grace_s=30.0).action == WAIT  # out of rotation after one failed request?
    verdict = decide([[]], roster, {A, B}, 31.0, grace_s=30.0, logs=str(tmp_path / "logs"))
    assert verdict.action == FAIL and "\n" not in verdict.message
    assert "launch.server_restarts used" in verdict.message
    for i, url in enumerate((A, B)):
        assert f"server {i} ({url}, restarted 3x, given up, log {tmp_path / 'logs'}/server{i}.log)" in verdict.message
    # no roster at all: nobody restarts servers
    bare = decide([[]], [], {A, B}, 31.0, grace_s=30.0)
    assert bare.action == FAIL and "no launcher roster" in bare.message and A in bare.message


def test_the_watch_keeps_the_outage_clock_and_counts_republishes(tmp_path: Path, capsys) -> None:
    out = str(tmp_path)
    write_roster(out, [RosterEntry(0, A, 0)])
    now = [0.0]
    watch = OutageWatch(roster_path(out), lambda: [A], str(tmp_path / "logs"), grace_s=10.0, clock=lambda: now[0])
    assert watch.check([[A]]).action == NONE
    assert watch.check([[]]).action == WAIT  # A dead, not given up: its restart may come
    assert watch.check([[]]).action == WAIT
    assert capsys.readouterr().out.count("waiting for the launcher") == 1  # said once
    write_roster(out, [RosterEntry(0, A2, 1)])  # back on a new port
    verdict = watch.check([[]])
    assert verdict.action == REPUBLISH and watch.republishes == 1 and "republishing" in capsys.readouterr().out
    assert watch.check([[A2]]).action == NONE
    # it dies again, for good: the outage clock starts anew, the run fails once it has run out
    write_roster(out, [RosterEntry(0, A2, 1, given_up=True)])
    now[0] = 100.0
    watch.known = lambda: [A2]
    assert watch.check([[]]).action == WAIT
    now[0] = 109.0
    assert watch.check([[]]).action == WAIT
    now[0] = 111.0
    with pytest.raises(ServersGone, match=r"no generation server is left .* after 11 s"):
        watch.check([[]])
    # a run without a roster
    bare = OutageWatch(None, lambda: [A], "logs", grace_s=0.0)
    with pytest.raises(ServersGone, match="no launcher roster"):
        bare.check([[]])


def test_an_update_that_finds_no_server_alive_sends_nothing() -> None:
    """Every server died since the last look: the version moves on, nothing is sent (the
    transport's collectives are skipped on every rank), generation resumes to an outage."""
    from realscale.publish.publisher import WeightPublisher

    class Control:
        def __init__(self, alive: bool) -> None:
            self.alive, self.calls = alive, []

        def pause(self, mode: str) -> None:
            self.calls.append("pause")

        def reachable(self) -> bool:
            return self.alive

        def resume(self, version: int) -> None:
            self.calls.append(("resume", version))

    class Transport:
        sent: list[int] = []

        def connect(self, engine, control) -> None: ...

        def send(self, engine, version, control):
            from realscale.publish.transport import SyncStats

            self.sent.append(version)
            return SyncStats(bytes=10)

    dead, live = Control(False), Control(True)
    transport = Transport()
    stats = WeightPublisher(transport, dead, "abort").publish(None, 3)
    assert transport.sent == [] and stats["perf/weight_sync_skipped"] == 1.0 and dead.calls == ["pause", ("resume", 3)]
    stats = WeightPublisher(transport, live, "abort").publish(None, 3)  # the same version again: a republish
    assert transport.sent == [3] and stats["perf/weight_sync_bytes"] == 10.0 and "perf/weight_sync_skipped" not in stats

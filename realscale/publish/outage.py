"""Every server of the rotation down at once: republish to the restarted ones, or fail.

A restarted generation server holds the base model, so it joins the rotation only once a
weight update has reached it (:mod:`realscale.inference.roster`). Weight updates follow
training steps, and a step needs a batch: when every server in rotation (or every server
of one rollout shard, ``rollout.processes``) is dead at once, no batch comes, no update
comes, and the restarted servers would wait for ever. So trainer rank 0 waits for its
batch in slices (:data:`POLL_S`), and between them :class:`OutageWatch` looks at which
servers the rollouts have in rotation (per shard) and at the launcher's roster:

- a shard with a server in rotation each: nothing to do (``none``);
- a shard without one, and restarted servers that no weight update has reached yet
  (roster URLs rank 0's client does not know): every trainer rank **republishes** the
  current policy version to them (the same version: the weights did not change; the
  update's liveness check retires the dead ones), they join the rotation and generation
  resumes (``republish``);
- a shard without one, no restarted server yet, but a dead server the launcher may still
  start again (in the roster, not given up, not in rotation): ``wait``;
- nothing can come back (every server out of rotation was given up, its
  ``launch.server_restarts`` used, or there is no roster: nobody restarts servers) and
  the outage has lasted :data:`FAIL_GRACE_S` (a live server out of rotation after a failed
  request comes back within seconds): ``fail``, one line naming every server and its log.

:func:`decide` is the rule (no I/O); :class:`OutageWatch` feeds it and keeps its clock.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from realscale.inference.roster import RosterEntry, read_roster

POLL_S = 2.0  # the driver's wait for a batch looks at the servers this often
FAIL_GRACE_S = 30.0  # no server can come back: how long an outage lasts before the run fails

NONE, WAIT, REPUBLISH, FAIL = "none", "wait", "republish", "fail"


class ServersGone(RuntimeError):
    """No generation server is left for a rollout shard, and none can come back."""


@dataclass(frozen=True)
class Verdict:
    action: str  # NONE, WAIT, REPUBLISH or FAIL
    pending: tuple[str, ...] = ()  # REPUBLISH: the restarted servers it goes to
    message: str = ""  # FAIL: the error, one line; WAIT: what it waits for (none within the grace)


def decide(rotation: Sequence[Collection[str]], roster: Sequence[RosterEntry], known: Collection[str],
           outage_s: float, grace_s: float = FAIL_GRACE_S, logs: str = "logs") -> Verdict:
    """What to do, given the URLs in rotation per rollout shard (``rotation``), the
    launcher's roster, the URLs rank 0's server control knows (``known``: every server a
    weight update went to or will go to, retired ones too), how long some shard has been
    without a server (``outage_s``), and where the servers' logs are (module docstring)."""

    empty = [i for i, urls in enumerate(rotation) if not urls]
    if not empty:
        return Verdict(NONE)
    pending = tuple(e.url for e in roster if e.url not in known)
    if pending:
        return Verdict(REPUBLISH, pending)
    live = set().union(*rotation)
    coming = [e for e in roster if not e.given_up and e.url not in live]
    where = "the rollouts" if len(rotation) == 1 else f"rollout shard(s) {empty} of {len(rotation)}"
    if coming:
        return Verdict(WAIT, message=f"no generation server in rotation for {where}; waiting for the launcher "
                                     f"to start again {_names(coming, logs)}")
    if outage_s < grace_s:
        return Verdict(WAIT)  # out of rotation after a failed request, maybe: the client probes it again
    if roster:
        servers = _names(roster, logs)
        why = "the launcher gave up on every dead one (launch.server_restarts used)"
    else:
        servers = ", ".join(sorted(known)) or "none"
        why = "no launcher roster lists restarted servers (nobody restarts them)"
    return Verdict(FAIL, message=f"no generation server is left for {where} after {outage_s:.0f} s and none can come "
                                 f"back: {why}; servers: {servers}")


def _names(entries: Sequence[RosterEntry], logs: str) -> str:
    return ", ".join(f"server {e.index} ({e.url}, restarted {e.restarts}x{', given up' if e.given_up else ''}, "
                     f"log {os.path.join(logs, f'server{e.index}.log')})" for e in entries)


@dataclass
class OutageWatch:
    """:func:`decide` fed on trainer rank 0: ``roster`` is the launcher's roster path (None:
    there is none), ``known`` gives the URLs rank 0's server control knows
    (:meth:`~realscale.publish.control.ServerControl.known`), ``logs`` the run's log
    folder. :meth:`check` raises :class:`ServersGone` on a ``fail`` verdict; each new
    ``wait`` message is printed once."""

    roster: str | None
    known: Callable[[], Collection[str]]
    logs: str
    grace_s: float = FAIL_GRACE_S
    clock: Callable[[], float] = time.monotonic
    republishes: int = 0  # how often the driver republished (the step log's rollout/republishes)
    _since: float | None = None
    _said: set[str] = field(default_factory=set)

    def check(self, rotation: Sequence[Collection[str]]) -> Verdict:
        if all(rotation):
            self._since = None
            return Verdict(NONE)
        now = self.clock()
        if self._since is None:
            self._since = now
        roster = read_roster(self.roster) if self.roster else []
        verdict = decide(rotation, roster, set(self.known()), now - self._since, self.grace_s, self.logs)
        if verdict.action == FAIL:
            raise ServersGone(verdict.message)
        if verdict.action == WAIT and verdict.message and verdict.message not in self._said:
            self._said.add(verdict.message)
            print(f"realscale: {verdict.message}", flush=True)
        if verdict.action == REPUBLISH:
            self.republishes += 1
            self._since = None
            print(f"realscale: no generation server in rotation; republishing the current weights to the restarted "
                  f"server(s) {', '.join(verdict.pending)} (republish {self.republishes})", flush=True)
        return verdict

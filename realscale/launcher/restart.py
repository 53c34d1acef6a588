"""Generation servers started again when they die, within the run (local processes or
Slurm job steps alike).

The backend's wait loop calls :meth:`ServerKeeper.check`: a server whose process (or
job step) has exited is started again on the same index (its log appends to
``logs/server<i>.log``), up to ``launch.server_restarts`` times per server. Once it
answers ``/health`` its URL goes into the run's roster (:mod:`realscale.inference.roster`),
where trainer rank 0 finds it before the next weight update: the update reaches it, then
it generates. Meanwhile the trainer's client has retired the dead one and resent its
requests to the others, so the run never stops for a server. When every server in
rotation is dead at once, rank 0 republishes the current weights to the restarted ones
while it waits for its batch (:mod:`realscale.publish.outage`); once the roster says
every dead server was given up, the run fails with their names and logs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from realscale.errors import LaunchError
from realscale.inference.roster import RosterEntry, read_retired, write_roster


class ServerHooks(Protocol):
    """What a backend offers the keeper for server ``i``."""

    def server_exit_code(self, i: int) -> int | None: ...  # None while it runs
    def respawn_server(self, i: int) -> None: ...  # end what is left of it, start it again (on the wait loop's thread)
    def server_ready(self, i: int) -> str: ...  # block until it answers /health: its URL; LaunchError if it cannot


@dataclass
class _Slot:
    url: str
    restarts: int = 0
    starting: threading.Thread | None = None
    given_up: bool = False


class ServerKeeper:
    """Watches the servers of one run and starts the dead ones again (module docstring)."""

    def __init__(self, out_dir: str, urls: list[str], limit: int, hooks: ServerHooks) -> None:
        self.out_dir, self.limit, self.hooks = out_dir, limit, hooks
        self.slots = [_Slot(u) for u in urls]
        self._lock = threading.Lock()
        self._publish()

    def check(self) -> None:
        """Start again every server that has exited since the last look, or that the
        trainer retired while it still runs (it did not answer a pause in time)."""
        retired = read_retired(self.out_dir)
        for i, slot in enumerate(self.slots):
            if slot.given_up or (slot.starting is not None and slot.starting.is_alive()):
                continue
            code = self.hooks.server_exit_code(i)
            if code is not None:
                why = f"exited with code {code}"
            elif slot.url in retired:
                why = "was retired by the trainer (it did not answer in time) and is ended"
            else:
                continue
            if slot.restarts >= self.limit:
                slot.given_up = True
                with self._lock:
                    self._publish()  # trainer rank 0 reads it: this one will not come back
                print(f"realscale: generation server {i} ({slot.url}) {why}; not started again "
                      f"(launch.server_restarts={self.limit} used); the run goes on with the others", flush=True)
                continue
            slot.restarts += 1
            print(f"realscale: generation server {i} ({slot.url}) {why}; starting it again "
                  f"({slot.restarts} of launch.server_restarts={self.limit})", flush=True)
            self.hooks.respawn_server(i)
            slot.starting = threading.Thread(target=self._await_ready, args=(i, slot), name=f"server{i}-restart",
                                             daemon=True)
            slot.starting.start()

    def _await_ready(self, i: int, slot: _Slot) -> None:
        try:
            url = self.hooks.server_ready(i)
        except LaunchError as exc:
            print(f"realscale: generation server {i} did not come back: {exc}", flush=True)
            return  # its process has exited or will be ended: the next check sees it
        with self._lock:
            slot.url = url
            self._publish()
        print(f"realscale: generation server {i} is back on {url}; it joins the next weight update", flush=True)

    def _publish(self) -> None:
        write_roster(self.out_dir, [RosterEntry(i, s.url, s.restarts, s.given_up) for i, s in enumerate(self.slots)])

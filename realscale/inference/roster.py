"""The run's generation servers as the launcher keeps them: ``<run>/launch/servers/roster.json``.

The supervisor is its one writer (an atomic replace each time): every server it started
with its index, its URL, how often it was restarted, and whether it gave up on it (dead
with its restarts used). Trainer rank 0 reads it before
each weight update: a URL it does not know is a restarted server, which joins that
update (the weight group or world is rebuilt with it) and then the rotation
(:meth:`realscale.inference.client.InferenceClient.add_server`). A server is never put
in rotation before it holds the run's current weights: it starts from the base model.

The other way, rank 0 appends to ``retired.txt`` beside it the URL of each server a
weight update retired; a retired server whose process still runs (it did not answer a
pause in time: stuck, or too slow) is ended and started again by the launcher.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RosterEntry:
    index: int  # the server's place in the run (its log is logs/server<index>.log)
    url: str
    restarts: int = 0  # how often the launcher started it again after it died
    given_up: bool = False  # dead, its restarts used (launch.server_restarts): it will not come back


def roster_path(out_dir: str) -> str:
    return os.path.join(out_dir, "launch", "servers", "roster.json")


def write_roster(out_dir: str, entries: list[RosterEntry]) -> None:
    path = roster_path(out_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump({"servers": [asdict(e) for e in entries]}, fh)
    os.replace(path + ".tmp", path)


def read_roster(path: str) -> list[RosterEntry]:
    """The entries at ``path`` (:func:`roster_path`); none when there is no roster yet."""
    try:
        with open(path, encoding="utf-8") as fh:
            return [RosterEntry(**e) for e in json.load(fh)["servers"]]
    except FileNotFoundError:
        return []


def _retired_path(roster: str) -> str:
    return os.path.join(os.path.dirname(roster), "retired.txt")


def report_retired(roster: str, urls: list[str]) -> None:
    """Rank 0: these servers left the run (the roster at ``roster`` is the run's)."""
    os.makedirs(os.path.dirname(roster), exist_ok=True)
    with open(_retired_path(roster), "a", encoding="utf-8") as fh:
        fh.writelines(u + "\n" for u in urls)


def read_retired(out_dir: str) -> set[str]:
    """The launcher: every URL rank 0 retired so far."""
    try:
        with open(_retired_path(roster_path(out_dir)), encoding="utf-8") as fh:
            return {line.strip() for line in fh if line.strip()}
    except FileNotFoundError:
        return set()

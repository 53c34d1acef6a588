"""The run directory as the meeting point of a launch.

Every role of a run finds what it needs under ``<run dir>/launch/`` (on storage every
node shares, see :mod:`realscale.launcher.slurm`):

``spec.json``           the run's spec: resolved config, model dir, server URLs, out dir
``sft-spec.json``       the same for the ranks of an SFT stage (the warm start, ``realscale sft``)
``servers-spec.json``   the same for the generation-server steps (with where their URLs go)
``servers/<key>/<i>.url``  generation server i's URL, written by the server itself once bound
``servers/roster.json`` the servers of the run now, restarts included (realscale/inference/roster.py)
``rdzv/<key>``          rank 0's ``host:port`` for torch.distributed (see dist_env.rendezvous)
``stop``                a stop request (preemption / time limit): the ranks checkpoint at
                        the next step boundary and exit; its text says why

Logs of every role go to ``<run dir>/logs/``.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

# The function a rank runs when a spec names none (specs written before ``entry`` existed).
TRAINER_ENTRY = "realscale.trainer:rank_main"


class EntryRef:
    """A rank's entry point by name (``module:function``), imported only where it is called.

    The supervisor hands it to the backend in place of the function, so it starts the
    servers and ranks without importing the loop itself (torch, the trainer: ~2.4 CPU-seconds
    on the 2-core default recipe, with the other core idle, before anything started). It
    pickles as its name; the rank imports the function and runs it."""

    def __init__(self, name: str) -> None:
        module, sep, function = name.partition(":")
        if not (sep and module and function):
            raise ValueError(f"entry point {name!r} is not 'module:function'")
        self.name = name

    def resolve(self) -> Callable[..., Any]:
        module, _, function = self.name.partition(":")
        fn = importlib.import_module(module)
        for part in function.split("."):
            fn = getattr(fn, part)
        return fn  # type: ignore[return-value]

    def __call__(self, *args: Any) -> Any:
        return self.resolve()(*args)

    def __repr__(self) -> str:
        return f"EntryRef({self.name!r})"


def entry_name(fn: Callable[..., Any]) -> str:
    """``module:function`` of a rank's entry point, as a spec names it."""
    if isinstance(fn, EntryRef):
        return fn.name
    return f"{fn.__module__}:{fn.__qualname__}"


@dataclass
class RunSpec:
    """What a rank or a server started by srun / torchrun / mpirun needs to know."""

    config: dict[str, Any]
    model_dir: str
    out_dir: str
    server_urls: list[str] = field(default_factory=list)
    url_dir: str = ""  # where servers write their URL files (this launch's)
    entry: str = TRAINER_ENTRY  # what each rank runs (entry_name): the RL loop, or an SFT stage

    def save(self, path: str) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(asdict(self), fh, indent=1)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str) -> "RunSpec":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"run spec not found: {path} (the launcher writes <run dir>/launch/spec.json)")
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        missing = {"config", "model_dir", "out_dir"} - set(data)
        if missing:
            raise ValueError(f"{path}: run spec lacks {sorted(missing)}")
        return cls(**data)


def launch_dir(out_dir: str) -> str:
    return os.path.join(out_dir, "launch")


def spec_path(out_dir: str, role: str = "") -> str:
    """The run spec of the trainer ranks, or of ``role`` ("servers": the server steps, which
    keep reading theirs while the run lasts: a restarted one starts from it)."""
    return os.path.join(launch_dir(out_dir), f"{role}-spec.json" if role else "spec.json")


def stop_path(out_dir: str) -> str:
    return os.path.join(launch_dir(out_dir), "stop")


def request_stop(out_dir: str, reason: str) -> None:
    """Ask the trainer ranks to checkpoint at the next step boundary and exit."""
    os.makedirs(launch_dir(out_dir), exist_ok=True)
    tmp = stop_path(out_dir) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(reason + "\n")
    os.replace(tmp, stop_path(out_dir))


def stop_reason(out_dir: str) -> str | None:
    """The pending stop request's reason, or None."""
    try:
        with open(stop_path(out_dir), encoding="utf-8") as fh:
            return fh.read().strip() or "stop"
    except FileNotFoundError:
        return None


def clear_stop(out_dir: str) -> None:
    try:
        os.remove(stop_path(out_dir))
    except FileNotFoundError:
        pass

"""Starting a run's processes: one launcher, two backends.

The supervisor (``realscale train``, :func:`realscale.launcher.supervisor.train`) prepares the model,
then asks a backend to start the generation servers, then the trainer ranks, and watches
them; one failing stops the rest. :func:`backend_for` picks the backend:

- :class:`~realscale.launcher.local.LocalBackend`: processes on this machine (the default);
- :class:`~realscale.launcher.slurm.SlurmBackend`: job steps (``srun``) of the Slurm
  allocation the supervisor runs in (``sbatch launch/slurm/*.sh``).

Under either, a trainer rank can also be started by hand through ``realscale rank``
(srun, torchrun or mpirun; :mod:`realscale.launcher.dist_env` derives its
torch.distributed environment). A stop request (``<run>/launch/stop``, written on
SIGUSR1) makes the ranks checkpoint at the next step boundary and exit; under Slurm the
job then requeues itself and resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from realscale.launcher.local import LocalBackend, RankGroup, ServerProc, start_servers, stop_servers, wait_healthy
from realscale.launcher.slurm import SlurmBackend, in_allocation
from realscale.launcher.spec import clear_stop, request_stop, stop_reason

if TYPE_CHECKING:
    from realscale.config import Config

__all__ = ["Backend", "LocalBackend", "RankGroup", "ServerProc", "backend_for", "clear_stop", "ranks_backend",
           "request_stop", "served", "start_servers", "stop_reason", "stop_servers", "wait_healthy"]


class Backend(Protocol):
    """What the supervisor asks of a backend (:class:`LocalBackend`, :class:`SlurmBackend`),
    in this order: prepare, start the servers (``wait=False``: not yet waiting for them to
    answer), start the ranks, wait until the servers answer (``servers_ready``), wait for
    the ranks, stop everything; ``requeue`` after a stop request (resume from the checkpoint)."""

    def prepare(self) -> None: ...

    def start_servers(self, model_dir: str, cfg_dict: dict[str, Any], wait: bool = True) -> list[str]: ...

    def servers_ready(self) -> None: ...

    def start_ranks(self, fn: Callable[..., Any], world: int, args: tuple, name: str = "trainer") -> None: ...

    def wait(self) -> int: ...

    def stop(self) -> None: ...

    def requeue(self) -> None: ...


def backend_for(cfg: Config, out_dir: str, ranks_only: bool = False) -> Backend:
    """``launch.backend``: local, slurm, or auto (slurm inside an allocation).
    ``ranks_only``: for a job of ranks without servers (:func:`ranks_backend`)."""

    kind = cfg.launch.backend
    if kind == "auto":
        kind = "slurm" if in_allocation() else "local"
    if kind == "slurm":
        return SlurmBackend(cfg, out_dir, ranks_only=ranks_only)
    return LocalBackend(cfg, out_dir)


def ranks_backend(cfg: Config, out_dir: str) -> Backend:
    """The backend of a job of ranks alone, an SFT stage (:func:`realscale.sft.run_sft`):
    the run's (local processes, or a Slurm job step on the trainer's nodes), its ranks
    bootstrapped from the same torch.distributed variables as trainer ranks."""
    return backend_for(cfg, out_dir, ranks_only=True)


@contextlib.contextmanager
def served(cfg: Config, model_dir: str, out_dir: str) -> Iterator[list[str]]:
    """Generation servers of ``model_dir`` for an evaluation (``generate.num_servers``,
    started by the run's backend); their URLs while the block runs, stopped after it."""
    backend = backend_for(cfg, out_dir)
    backend.prepare()
    try:
        yield backend.start_servers(model_dir, asdict(cfg))
    finally:
        backend.stop()

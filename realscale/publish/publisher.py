"""pause -> move -> version -> resume: :class:`WeightPublisher`, and the transport a config
names (:func:`transport_for`). The protocol is described in :mod:`realscale.publish`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from realscale.inference.vllm_server import weight_engine
from realscale.parallel.device import backend
from realscale.publish.broadcast import BroadcastTransport
from realscale.publish.control import ServerControl
from realscale.publish.disk import DiskTransport
from realscale.publish.reshard import ReshardTransport
from realscale.publish.transport import SyncStats, WeightTransport, any_over_ranks
from realscale.publish.vllm import VllmEngineTransport

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.train.engine import MegatronEngine


class Publisher(Protocol):
    """What the trainer holds to get its weights to the generators: a :class:`WeightPublisher`
    (servers of their own), or in colocated mode the ranks' own generation layout
    (:class:`realscale.serve.colocated.ColocatedGeneration`). Every trainer rank calls both."""

    def publish(self, engine: MegatronEngine, version: int) -> dict[str, float]: ...

    def close(self) -> None: ...


class WeightPublisher:
    """pause -> move -> version -> resume (the module docstring). Every trainer rank holds
    one; ``control`` only on rank 0."""

    def __init__(self, transport: WeightTransport, control: ServerControl | None, pause_mode: str) -> None:
        self.transport = transport
        self.control = control
        self.pause_mode = pause_mode
        self.connected = False

    def publish(self, engine: "MegatronEngine", version: int) -> dict[str, float]:
        """One update to ``version`` (every trainer rank). When no server answers (every one
        died since the last look), nothing is sent: the run goes on at ``version``, and
        rank 0 republishes it to the servers the launcher starts again while it waits for
        its next batch (:mod:`realscale.publish.outage`)."""
        start = time.perf_counter()
        if not self.connected:
            self.transport.connect(engine, self.control)
            self.connected = True
        if self.control is not None:
            self.control.pause(self.pause_mode)
        nobody = self.control is not None and not self.control.reachable()
        if any_over_ranks(nobody):  # every rank learns it: the transport's collectives are skipped together
            stats = SyncStats(extra={"perf/weight_sync_skipped": 1.0})
            if self.control is not None:
                print(f"realscale: no generation server answers for weight version {version}; it goes to the "
                      "servers the launcher starts again", flush=True)
        else:
            stats = self.transport.send(engine, version, self.control)
        if self.control is not None:
            self.control.resume(version)
        stats.seconds = time.perf_counter() - start
        return stats.metrics()

    def close(self) -> None:
        self.transport.close()
        if self.control is not None:
            self.control.close()


def transport_for(cfg: "Config", out_dir: str) -> WeightTransport:
    """The transport ``generate.weight_update`` names: disk, or ``distributed`` = the
    reshard transport for embedded servers, vLLM's engine for vLLM, SGLang's broadcast for SGLang."""

    if cfg.generate.weight_update == "disk":
        return DiskTransport(out_dir, pause_mode=cfg.generate.pause_mode)
    if cfg.generate.backend == "embedded":
        return ReshardTransport(backend(cfg.parallel.backend))
    if cfg.generate.backend == "vllm":
        return VllmEngineTransport(weight_engine(backend(cfg.parallel.backend) == "nccl", cfg.generate.vllm_weight_engine))
    return BroadcastTransport(backend(cfg.parallel.backend), pause_mode=cfg.generate.pause_mode)

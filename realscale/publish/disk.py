"""The fallback transport: an HF directory per version on shared storage, loaded by every server."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from realscale.publish.control import ServerControl
from realscale.publish.transport import SyncStats, WeightTransport, flush_after_update

if TYPE_CHECKING:
    from realscale.train.engine import MegatronEngine


class DiskTransport(WeightTransport):
    """An HF directory per version under ``<run>/weights/``, loaded by every server.

    Storage stays bounded: once every server has loaded version v (the update returned
    success from each of them; a server that did not answer was retired and never loads
    again), every older version is deleted. So at most two versions are on disk, and two
    only while the newer one is being written and loaded."""

    def __init__(self, out_dir: str, pause_mode: str = "abort") -> None:
        self.root = os.path.join(out_dir, "weights")
        self.flush_cache = flush_after_update(pause_mode)

    def connect(self, engine: "MegatronEngine", control: ServerControl | None) -> None:
        os.makedirs(self.root, exist_ok=True)

    def send(self, engine: "MegatronEngine", version: int, control: ServerControl | None) -> SyncStats:
        path = os.path.join(self.root, f"v{version}")
        engine.save_hf(path)
        written = 0
        if control is not None:
            control.run(lambda c: c.update_weights_from_disk(path, weight_version=version,
                                                             flush_cache=self.flush_cache))
            written = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
            self.prune_before(version)
        return SyncStats(bytes=written, lower_bound=written)

    def prune_before(self, version: int) -> list[str]:
        """Delete every version older than ``version`` (all servers hold ``version``)."""

        deleted = []
        for name in os.listdir(self.root):
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < version:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                deleted.append(name)
        return deleted

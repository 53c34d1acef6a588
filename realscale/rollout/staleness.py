"""The staleness rule that bounds how far rollouts may run ahead of training.

With batch size B (prompts per step), weight version v and bound η, the controller may
have at most ``(η + v + 1)·B`` groups accepted-or-running in total, and at most
``max_concurrent`` running at once (ARCHITECTURE.md, "A run")::

    capacity(v) = min(max_concurrent − running, (η + v + 1)·B − (accepted + running))

``accepted`` is cumulative: every group that entered the buffer (and so will be, or has
been, trained) counts. Rejected groups (filtered, failed) free their slot without
counting, which is how dynamic sampling draws replacements. η = 0 is synchronous RL:
at version v exactly B groups can be accepted before the trainer moves to v + 1.

The rule bounds how far *submissions* run ahead; a slow episode that started long ago can
still finish late. The controller therefore trains groups oldest submission first and
waits for a group that would otherwise age past η (see ``RolloutController``, "Batching"),
so the bound holds for every trained token. Should a group still arrive too stale (a
trainer that skips versions), it is dropped and regenerated; :meth:`on_discard` takes
such a group back out of ``accepted``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class StalenessManager:
    """Counts running / accepted / rejected groups and answers how many more may start."""

    def __init__(self, batch_size: int, max_staleness: int, max_concurrent: int) -> None:
        for name, value, lo in (("batch_size", batch_size, 1), ("max_staleness", max_staleness, 0),
                                ("max_concurrent", max_concurrent, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"StalenessManager: {name} must be an int >= {lo}, got {value!r}")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self.running = 0
        self.accepted = 0
        self.rejected = 0
        self.submitted = 0

    # ------------------------------------------------------------------ the rule

    def limit(self, version: int) -> int:
        """(η + v + 1)·B: the most groups that may ever be accepted-or-running at ``version``."""
        if version < 0:
            raise ValueError(f"StalenessManager: version must be >= 0, got {version}")
        return (self.max_staleness + version + 1) * self.batch_size

    def capacity(self, version: int) -> int:
        """How many more prompts may be submitted now (never negative)."""
        by_concurrency = self.max_concurrent - self.running
        by_staleness = self.limit(version) - (self.accepted + self.running)
        return max(0, min(by_concurrency, by_staleness))

    def due(self, running_by_version: Mapping[int, int], version: int) -> int:
        """Groups still generating that the next batch must wait for: those submitted at a
        version <= ``version`` − η would age past the bound if trained any later. One rule
        for the controller and the simulator."""
        oldest_ok = version - self.max_staleness
        return sum(n for v, n in running_by_version.items() if v <= oldest_ok and n > 0)

    def too_stale(self, min_version: int, version: int) -> bool:
        """Would a group whose oldest token is ``min_version`` break the bound at ``version``?"""
        return version - min_version > self.max_staleness

    # ------------------------------------------------------------------ events

    def on_submit(self) -> None:
        """A prompt started (one group in flight)."""
        self.running += 1
        self.submitted += 1

    def on_accept(self) -> None:
        """A running group finished and entered the buffer."""
        self._finish("on_accept")
        self.accepted += 1

    def on_reject(self) -> None:
        """A running group finished but will not be trained (filtered out, failed, too stale)."""
        self._finish("on_reject")
        self.rejected += 1

    def on_discard(self) -> None:
        """An accepted group was dropped before training (too stale): its slot opens again."""
        if self.accepted <= 0:
            raise RuntimeError("StalenessManager.on_discard: no accepted group to discard")
        self.accepted -= 1
        self.rejected += 1

    def _finish(self, what: str) -> None:
        if self.running <= 0:
            raise RuntimeError(f"StalenessManager.{what}: no group is running")
        self.running -= 1

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Counters as of now. Running groups are not saved: a resumed run regenerates them,
        so ``running`` is folded back to 0 by :meth:`load_state_dict`."""
        return {"batch_size": self.batch_size, "max_staleness": self.max_staleness,
                "max_concurrent": self.max_concurrent, "running": self.running,
                "accepted": self.accepted, "rejected": self.rejected, "submitted": self.submitted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters; in-flight groups of the saved run count as not submitted."""
        if state.get("batch_size", self.batch_size) != self.batch_size:
            raise ValueError(f"staleness state has batch_size={state['batch_size']} but this run uses "
                             f"{self.batch_size}; the accepted count would mean a different step")
        self.accepted = int(state["accepted"])
        self.rejected = int(state.get("rejected", 0))
        self.submitted = int(state.get("submitted", 0)) - int(state.get("running", 0))
        self.running = 0

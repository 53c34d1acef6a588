"""How long a generation request, and a trainer's wait for a batch, may take.

A fixed limit (the old 600 s) ends a 27k-token answer that is decoding normally, and is
far too generous for a 24-token answer on a hung server. Limits here follow from the work
asked for and the speed measured on this run:

- **request**: ``generate.request_timeout`` > 0 is a fixed limit; -1 is none; 0 (auto) is
  ``timeout_slack`` times the time the request's remaining token budget takes at the
  *slowest* per-request decode rate among the last answers measured (tokens over active
  seconds of a request, queueing included), plus a floor for prefill and queueing.
  Before any answer has been measured there is no limit: a first guess would be either
  wrong for long generations or useless for short ones.
- **active time**: time while the client has the servers paused (a weight update in
  ``retract`` / ``in_place`` mode holds requests) does not count against a request.
- **batch**: the trainer waits for B groups of n answers; they take ``waves`` rounds of
  full-length requests on ``servers × max_running`` decoding slots (plus one for a group
  that must wait for its due siblings), so the batch limit is ``waves`` request limits,
  re-evaluated while waiting, and none while the request limit is none.

A request past its limit is aborted on its server (``/abort_request`` with its rid); the
server answers the request with its partial output, which the client keeps, and the
rest of the budget is resent (:meth:`realscale.inference.client.InferenceClient.generate`).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Callable

OFF = -1.0
AUTO = 0.0
FLOOR_S = 30.0  # prefill, queueing and one HTTP round trip, beyond the decode time
MIN_MEASURED_TOKENS = 8  # shorter answers say more about overhead than about decode speed
WINDOW = 64  # answers whose rates are remembered


class RequestTimeouts:
    """Per-request limits from the token budget and the measured decode rate (module docstring)."""

    def __init__(self, setting: float = AUTO, slack: float = 4.0, clock: Callable[[], float] = time.monotonic) -> None:
        if setting < 0 and setting != OFF:
            raise ValueError(f"request timeout: -1 (off), 0 (auto) or seconds > 0, got {setting!r}")
        if slack <= 1:
            raise ValueError(f"timeout slack must be > 1, got {slack!r}")
        self.setting = float(setting)
        self.slack = float(slack)
        self.clock = clock
        self.rates: collections.deque[float] = collections.deque(maxlen=WINDOW)
        # (seconds paused before the current pause, when the current pause began or None),
        # replaced whole: rank 0's thread holds and releases the clocks while the client's
        # loop reads them, and neither waits for the other (a saturated loop is seconds behind)
        self._pauses: tuple[float, float | None] = (0.0, None)

    # ------------------------------------------------------------------ measurements

    def observe(self, tokens: int, active_seconds: float) -> None:
        """A request (segment) produced ``tokens`` in ``active_seconds`` of unpaused time."""
        if tokens >= MIN_MEASURED_TOKENS and active_seconds > 0:
            self.rates.append(tokens / active_seconds)

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second of the slowest recent request, or None before any was measured."""
        return min(self.rates) if self.rates else None

    # ------------------------------------------------------------------ pauses

    def pause(self) -> None:
        total, since = self._pauses
        if since is None:
            self._pauses = (total, self.clock())

    def resume(self) -> None:
        total, since = self._pauses
        if since is not None:
            self._pauses = (total + self.clock() - since, None)

    @property
    def paused(self) -> bool:
        return self._pauses[1] is not None

    def mark(self) -> tuple[float, float]:
        """A start mark for :meth:`active_since`."""
        return self.clock(), self._paused_now()

    def active_since(self, mark: tuple[float, float]) -> float:
        """Seconds since ``mark`` that the servers were not paused by this client."""
        start, paused = mark
        return (self.clock() - start) - (self._paused_now() - paused)

    def _paused_now(self) -> float:
        total, since = self._pauses
        return total + (self.clock() - since if since is not None else 0.0)

    # ------------------------------------------------------------------ limits

    def limit(self, max_new_tokens: int) -> float | None:
        """Seconds a request for ``max_new_tokens`` more tokens may take; None: no limit."""
        if self.setting == OFF:
            return None
        if self.setting > 0:
            return self.setting
        rate = self.decode_rate
        if rate is None:
            return None
        return FLOOR_S + self.slack * max(1, max_new_tokens) / rate

    def batch_limit(self, max_new_tokens: int, answers: int, slots: int) -> float | None:
        """Seconds a trainer may wait for a batch of ``answers`` answers of at most
        ``max_new_tokens`` tokens, decoded ``slots`` at a time; None: no limit."""
        one = self.limit(max_new_tokens)
        if one is None:
            return None
        waves = math.ceil(answers / max(1, slots)) + 1
        return waves * one

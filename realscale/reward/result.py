"""What a reward function returns: a value and the reason it has that value."""

from __future__ import annotations

from dataclasses import dataclass

# Reasons a check can end with. "ok" means the check ran to a verdict (value 1 or 0);
# every other reason scores 0 and says why, so that the run's stats show what went wrong.
OK = "ok"
TIMEOUT = "timeout"
CRASH = "crash"
TOO_LONG = "too_long"
NO_ANSWER = "no_answer"
ERROR = "error"
SANDBOX = "sandbox"  # the code sandbox refused to run (a layer of isolation is missing)
REASONS = (OK, TIMEOUT, CRASH, TOO_LONG, NO_ANSWER, ERROR, SANDBOX)


@dataclass(frozen=True)
class RewardResult:
    """The score of one answer: ``value`` in [0, 1] and why (one of :data:`REASONS`)."""

    value: float
    reason: str = OK
    detail: str = ""

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"RewardResult.reason: {self.reason!r} is not one of {', '.join(REASONS)}")

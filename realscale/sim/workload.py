"""What a simulated run generates: answer lengths, and which groups the trainer keeps.

Answer lengths are drawn per answer from a :class:`LengthDist`:

- :class:`Lognormal` (median, sigma), the usual shape of reasoning-trace lengths; draws
  above the generation cap are truncated to it (the answer is cut at ``max_new_tokens``,
  as a server does), so one distribution serves every context length;
- :class:`Histogram`: measured lengths and their weights;
- :class:`PowerLawMix`: the long-tail task's own law (``benchmarks/bench_async.py``):
  ``tokens_per_step * n`` tokens with ``P(n) ∝ n^-alpha``, mixed with short bare answers.

A group (``n_samples`` answers to one prompt) is kept or dropped by an
:class:`AcceptModel`: :class:`AcceptAll` (no filter), or :class:`Reliability`, a model of
DAPO's all-equal filter on a task whose answers are right with a probability that falls
with their length (each worked step right with probability ``rho``; bare answers right
with ``p_bare``): a group is kept when its rewards are not all equal. Under that filter the
kept groups are the longer ones, as on the real task.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class WorkloadError(ValueError):
    """A malformed length distribution or acceptance model."""


class LengthDist(Protocol):
    def sample(self, rng: np.random.Generator, n: int, cap: int) -> np.ndarray: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Lognormal:
    """Lognormal lengths (tokens), at least 1, truncated to the cap."""

    median: float
    sigma: float

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0):
            raise WorkloadError(f"lognormal lengths need median > 0 and sigma >= 0, got {self.median}, {self.sigma}")

    def sample(self, rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
        x = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(x), 1, cap).astype(np.int64)

    def mean(self, cap: int, n: int = 200_000, seed: int = 0) -> float:
        return float(self.sample(np.random.default_rng(seed), n, cap).mean())

    def describe(self) -> str:
        return f"lognormal(median {self.median:.0f}, sigma {self.sigma:.2f})"


@dataclass(frozen=True)
class Histogram:
    """Measured lengths with weights (e.g. from a run's logs)."""

    lengths: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.weights) or min(self.weights) < 0 \
                or sum(self.weights) <= 0 or min(self.lengths) < 1:
            raise WorkloadError("histogram needs equally many lengths (>= 1) and weights (>= 0, not all 0)")

    def sample(self, rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
        p = np.asarray(self.weights, np.float64)
        x = rng.choice(np.asarray(self.lengths, np.int64), size=n, p=p / p.sum())
        return np.minimum(x, cap)

    def describe(self) -> str:
        return f"histogram ({len(self.lengths)} bins)"


@dataclass(frozen=True)
class PowerLawMix:
    """The long-tail task: worked answers of ``tokens_per_step * n`` tokens with ``n`` on
    ``lo..hi``, ``P(n) ∝ n^-alpha``, in a fraction ``worked`` of answers; the rest are bare
    answers of ``bare_tokens`` tokens. ``steps`` returns each answer's ``n`` (0: bare) so an
    :class:`AcceptModel` can score it."""

    lo: int
    hi: int
    alpha: float
    tokens_per_step: int
    worked: float
    bare_tokens: int = 2

    def __post_init__(self) -> None:
        if not (1 <= self.lo <= self.hi and 0 <= self.worked <= 1 and self.tokens_per_step >= 1):
            raise WorkloadError(f"power-law mix: need 1 <= lo <= hi and 0 <= worked <= 1, got {self}")

    def _law(self) -> tuple[np.ndarray, np.ndarray]:
        n = np.arange(self.lo, self.hi + 1)
        p = n.astype(np.float64) ** -self.alpha
        return n, p / p.sum()

    def steps(self, rng: np.random.Generator, count: int) -> np.ndarray:
        n, p = self._law()
        worked = rng.random(count) < self.worked
        return np.where(worked, rng.choice(n, size=count, p=p), 0)

    def lengths_of(self, steps: np.ndarray, cap: int) -> np.ndarray:
        return np.minimum(np.where(steps > 0, steps * self.tokens_per_step, self.bare_tokens), cap)

    def sample(self, rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
        return self.lengths_of(self.steps(rng, n), cap)

    def worked_mean(self) -> float:
        n, p = self._law()
        return float((n * p).sum() * self.tokens_per_step)

    def describe(self) -> str:
        return (f"power law n^-{self.alpha:g} on {self.lo}..{self.hi} x {self.tokens_per_step} tokens, "
                f"{self.worked:.0%} worked, the rest {self.bare_tokens} tokens")


class AcceptModel(Protocol):
    def accept(self, rng: np.random.Generator, steps: np.ndarray) -> bool: ...


@dataclass(frozen=True)
class AcceptAll:
    """No filter: every group is trained."""

    def accept(self, rng: np.random.Generator, steps: np.ndarray) -> bool:
        return True


@dataclass(frozen=True)
class AcceptFraction:
    """A fixed fraction of groups is kept, whatever their lengths."""

    p: float

    def __post_init__(self) -> None:
        if not 0 < self.p <= 1:
            raise WorkloadError(f"acceptance fraction must be in (0, 1], got {self.p}")

    def accept(self, rng: np.random.Generator, steps: np.ndarray) -> bool:
        return bool(rng.random() < self.p)


@dataclass(frozen=True)
class Reliability:
    """DAPO's all-equal filter on a length-dependent reward: an answer of ``n`` worked steps is
    right with probability ``rho ** n``, a bare one (``n = 0``) with ``p_bare``; the group is
    kept unless all its answers are right or all wrong."""

    rho: float
    p_bare: float = 0.1

    def __post_init__(self) -> None:
        if not (0 < self.rho <= 1 and 0 <= self.p_bare <= 1):
            raise WorkloadError(f"reliability model: need 0 < rho <= 1 and 0 <= p_bare <= 1, got {self}")

    def p_right(self, steps: np.ndarray) -> np.ndarray:
        return np.where(steps > 0, self.rho ** steps.astype(np.float64), self.p_bare)

    def accept(self, rng: np.random.Generator, steps: np.ndarray) -> bool:
        right = rng.random(len(steps)) < self.p_right(steps)
        return bool(right.any() and not right.all())


@dataclass
class Workload:
    """One RL step's shape: ``batch`` prompts x ``n_samples`` answers of ``prompt_len`` +
    drawn lengths (at most ``max_new_tokens``)."""

    batch: int
    n_samples: int
    prompt_len: int
    max_new_tokens: int
    lengths: LengthDist
    accept: AcceptModel = field(default_factory=AcceptAll)

    def __post_init__(self) -> None:
        for name in ("batch", "n_samples", "prompt_len", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"workload: {name} must be >= 1, got {getattr(self, name)}")

    def draw_group(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, steps) of one group's answers; ``steps`` is what the accept model scores."""
        if isinstance(self.lengths, PowerLawMix):
            steps = self.lengths.steps(rng, self.n_samples)
            return self.lengths.lengths_of(steps, self.max_new_tokens), steps
        lengths = self.lengths.sample(rng, self.n_samples, self.max_new_tokens)
        return lengths, lengths

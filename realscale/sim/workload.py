"""What a simulated run generates: answer lengths, and which groups the trainer keeps.

Answer lengths are drawn per answer from a :class:`LengthDist`:

- :class:`Lognormal` (median, sigma), the usual shape of reasoning-trace lengths; draws
  above the generation cap are truncated to it (the answer is cut at ``max_new_tokens``,
  as a server does), so one distribution serves every context length;
- :class:`Histogram`: measured lengths and their weights;
- :class:`TaskMix`: a procedural task's own answers (``realscale/tasks``), worked out or
  bare, one problem per group (the long-tail task of ``benchmarks/bench_async.py``).

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

from realscale.errors import UserError


class WorkloadError(UserError):
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
class TaskMix:
    """A procedural task's answers: a group is one problem (drawn uniformly from the task's
    training split, so with the task's own length law); each of its answers is worked out
    (``worked_lens[i]`` tokens) with probability ``worked``, else answered bare
    (``bare_lens[i]`` tokens). The answers of a group share their problem, as in a real run.
    What an :class:`AcceptModel` scores is each answer's worked length (0: bare)."""

    bare_lens: tuple[int, ...]
    worked_lens: tuple[int, ...]
    worked: float

    def __post_init__(self) -> None:
        if not self.bare_lens or len(self.bare_lens) != len(self.worked_lens) or not 0 <= self.worked <= 1:
            raise WorkloadError("task mix: need one bare and one worked length per problem and 0 <= worked <= 1")

    def draw_group(self, rng: np.random.Generator, n_samples: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
        i = int(rng.integers(len(self.bare_lens)))
        worked = rng.random(n_samples) < self.worked
        lengths = np.minimum(np.where(worked, self.worked_lens[i], self.bare_lens[i]), cap).astype(np.int64)
        return lengths, np.where(worked, self.worked_lens[i], 0)

    def sample(self, rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
        return np.concatenate([self.draw_group(rng, 1, cap)[0] for _ in range(n)])

    def mean(self) -> float:
        return float(self.worked * np.mean(self.worked_lens) + (1 - self.worked) * np.mean(self.bare_lens))

    def describe(self) -> str:
        return (f"task mix of {len(self.bare_lens)} problems: {self.worked:.0%} worked (mean "
                f"{np.mean(self.worked_lens):.0f} tokens), the rest bare (mean {np.mean(self.bare_lens):.1f})")


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
    """DAPO's all-equal filter on a length-dependent reward: a worked answer of ``n`` tokens
    is right with probability ``rho ** n`` (every token must be right), a bare one
    (``n = 0``) with ``p_bare``; the group is kept unless all its answers are right or all
    wrong."""

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

    def mean_length(self, n: int = 20_000, seed: int = 0) -> float:
        """Mean answer tokens (a fixed-seed estimate)."""
        rng = np.random.default_rng(seed)
        groups = max(1, n // self.n_samples)
        return float(np.mean(np.concatenate([self.draw_group(rng)[0] for _ in range(groups)])))

    def draw_group(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, steps) of one group's answers; ``steps`` is what the accept model scores."""
        if isinstance(self.lengths, TaskMix):
            return self.lengths.draw_group(rng, self.n_samples, self.max_new_tokens)
        lengths = self.lengths.sample(rng, self.n_samples, self.max_new_tokens)
        return lengths, lengths

"""Countdown with a running digit: a procedural task whose response length is long-tailed.

Built for the async-vs-sync benchmark (``benchmarks/bench_async.py``): a synchronous RL
batch waits for its longest response, so the task's response length must have a heavy
tail, as real reasoning traces do, while staying learnable by a tiny model on a CPU.

A problem is a start digit ``x`` and a step count ``n``. The scratchpad counts ``c`` down
from ``n`` to 1 and, at each step, moves a running digit on by ``STRIDE`` (3) mod 10,
starting from ``x``; the answer is the last digit, ``(x + 3n) mod 10``::

    prompt:      7 4
    worked:      04:0 03:3 02:6 01:9<|endoftext|>   (what the SFT warm start teaches)
    answer:      9

With the byte-level tiny tokenizer (one token per character) an item is 5 tokens
(counters are zero-padded to two digits), so the response is ``5n`` tokens, EOS included,
and ``n`` is drawn from a truncated discrete power law ``P(n) ∝ n^-alpha`` on
``min_steps..max_steps``. With the defaults (2..64, alpha 1.5): median 5 steps (25
tokens), mean ~10 (~49 tokens), longest 64 (320 tokens).

Why this shape: every token is a function of the few tokens before it, at fixed offsets
(the previous counter and running digit), so a tiny transformer learns the procedure in a
short warm start, yet a sampled answer is right only when all of its ``5n`` tokens are, so
the difficulty grows with the length, the long-tail shape RL sees on reasoning tasks.
Earlier versions taught harder steps and a 0.85M-parameter model did not learn them in a
few hundred warm-start steps: summing labelled digits of the prompt (a lookup into the
prompt) stayed at chance, and adding the counter to the running digit (a 10x10 table)
reached 11% held-out after 250 steps. The stride 3 is coprime to 10 (every digit is
reached) and keeps the answer from being a copy of ``n``'s last digit.

The final number of the completion is the answer, so the RL math reward (final number,
exact) and :func:`realscale.tasks.arith.is_correct` score it unchanged.

What RL learns here: with ``data.task_worked_fraction`` below 1 the warm start also sees
bare answers ("7 4" -> "9"), as the arithmetic task's does. A tiny model cannot compute
``(x + 3n) mod 10`` in one token step, so a bare answer is a guessed digit (right ~10% of
the time) while a worked one is right ~97% of the time after 800 SFT steps of a 70/30 mix;
the warm-started policy picks a style at random (~68% sampled). RL learns that working it
out pays, and its answers grow into the long tail as it does (``configs/long_tail_cpu.yaml``).

Why not scratchpads alone: then there is little for RL to raise, and what there is, it
lowers. A policy that stops after two items guesses the last digit right one time in ten,
and at lr 1e-4 RL learnt to stop early (greedy 28% -> 4% in 48 steps from a 150-step warm
start). Checking the whole scratchpad closes that, yet from a warm start 66% right greedy
and 30% sampled, RL still lowered held-out accuracy, synchronous RL at lr 2e-5 included
(greedy 66% -> 40% in 48 steps; 2026-11-21, not committed). The likely cause is credit
assignment: a wrong 300-token answer has one wrong digit, and a sequence-level advantage
pushes down the ~299 right ones with it.

Splits: for each step count ``n`` one start digit of the ten is held out, picked by a hash
of ``n`` keyed with ``seed``. The training split is ``train_size`` draws from the law that
reject held-out problems; the held-out split is ``heldout_size`` draws from the law that
keep only held-out problems. So the splits are disjoint, both follow the length law
exactly, and they are identical on every machine and run with that seed.
Problems repeat within a split (the space has ``10 * (max_steps - min_steps + 1)`` of
them), as they do under the law.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from realscale.config import DataConfig

NAME = "long_tail"
STRIDE = 3  # the running digit's step (coprime to 10)
MAX_STEPS = 99  # counters stay within two digits


@dataclass(frozen=True)
class CountdownProblem:
    """One problem: start digit ``start`` and ``steps`` countdown steps."""

    start: int
    steps: int

    @property
    def prompt(self) -> str:
        return f"{self.start} {self.steps}"

    def worked(self) -> str:
        """The worked answer (the style SFT teaches with ``data.task_worked_fraction`` 1): the
        scratchpad, whose last number is the answer."""
        items, v = [], self.start
        for c in range(self.steps, 0, -1):
            v = (v + STRIDE) % 10
            items.append(f"{c:02d}:{v}")
        return " ".join(items)

    @property
    def answer(self) -> str:
        return str((self.start + STRIDE * self.steps) % 10)

    @property
    def metadata(self) -> dict[str, Any]:
        return {"task": NAME, "start": self.start, "steps": self.steps}


@dataclass(frozen=True)
class LongTailTask:
    """The problem law and its seeded train / held-out split."""

    min_steps: int = 2
    max_steps: int = 64
    alpha: float = 1.5
    train_size: int = 4096
    heldout_size: int = 400
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps <= MAX_STEPS:
            raise ValueError(f"long_tail task: need 1 <= min_steps <= max_steps <= {MAX_STEPS}, got "
                             f"min_steps={self.min_steps}, max_steps={self.max_steps}")
        if not self.alpha > 0:
            raise ValueError(f"long_tail task: alpha (the tail exponent) must be > 0, got {self.alpha}")
        if self.train_size < 1 or self.heldout_size < 1:
            raise ValueError(f"long_tail task: train_size and heldout_size must be >= 1, got "
                             f"{self.train_size} and {self.heldout_size}")

    def all_problems(self) -> list[CountdownProblem]:
        """Every problem of the space, in a fixed order (steps, then start)."""
        return [CountdownProblem(x, n) for n in range(self.min_steps, self.max_steps + 1) for x in range(10)]

    def step_probs(self) -> np.ndarray:
        """P(n) for n = min_steps..max_steps."""
        ns = np.arange(self.min_steps, self.max_steps + 1, dtype=np.float64)
        w = ns ** -self.alpha
        return w / w.sum()

    def is_heldout(self, problem: CountdownProblem) -> bool:
        """Whether ``problem`` is held out: for each step count, one start digit of the ten,
        picked by a hash keyed with ``seed`` (so both splits follow the length law)."""
        key = self.seed.to_bytes(8, "little", signed=True)
        digest = hashlib.blake2b(bytes([problem.steps]), digest_size=8, key=key).digest()
        return problem.start == int.from_bytes(digest, "little") % 10

    @cached_property
    def _splits(self) -> dict[str, list[CountdownProblem]]:
        ns = np.arange(self.min_steps, self.max_steps + 1)
        probs = self.step_probs()
        out = {}
        for offset, (name, size, keep) in enumerate((("train", self.train_size, False),
                                                    ("heldout", self.heldout_size, True))):
            rng = np.random.default_rng([self.seed, offset])  # one stream per split: sizes are independent
            problems: list[CountdownProblem] = []
            while len(problems) < size:
                p = CountdownProblem(int(rng.integers(0, 10)), int(rng.choice(ns, p=probs)))
                if self.is_heldout(p) == keep:
                    problems.append(p)
            out[name] = problems
        return out

    def split(self, name: str) -> list[CountdownProblem]:
        """``"train"`` or ``"heldout"``: disjoint, deterministic given the knobs and ``seed``."""
        if name not in ("train", "heldout"):
            raise ValueError(f"long_tail task: split must be 'train' or 'heldout', got {name!r}")
        return list(self._splits[name])

    def length_strata(self, budget: int) -> list[tuple[int, float, list[CountdownProblem]]]:
        """An evaluation set stratified by length: ``(n, P(n), problems)`` for every step count.

        Each step count gets ``max(1, round(budget * P(n)))`` problems, its ten start digits in
        turn (from an offset that moves with ``n``, so short strata do not all favour digit 0),
        train and held-out problems alike. ``sum P(n) * (share right in stratum n)`` then
        estimates accuracy under the task's law with no draw noise in which lengths and problems
        appear, and no single problem weighs more than a tenth of its length's probability. The
        held-out split cannot give that: it holds one problem per length, so one problem is
        P(2) = 25% of its score (``bench_async.py`` reports both).
        """
        if budget < 1:
            raise ValueError(f"long_tail task: evaluation budget must be >= 1, got {budget}")
        strata = []
        for n, p in zip(range(self.min_steps, self.max_steps + 1), self.step_probs()):
            count = max(1, round(budget * float(p)))
            strata.append((n, float(p), [CountdownProblem((3 * n + i) % 10, n) for i in range(count)]))
        return strata

    @classmethod
    def from_config(cls, data_cfg: DataConfig) -> "LongTailTask":
        """The task a :class:`realscale.config.DataConfig` describes (``size``, ``task_*`` knobs)."""
        return cls(min_steps=data_cfg.task_min_steps, max_steps=data_cfg.task_max_steps,
                   alpha=data_cfg.task_tail_alpha, train_size=data_cfg.size, heldout_size=data_cfg.task_heldout,
                   seed=data_cfg.task_seed)

"""Prompt datasets: JSONL / Parquet files and reasoning-gym procedural tasks.

:class:`PromptDataset` loads every row once, checks it against the prompt schema (a bad
row is skipped, counted in :attr:`PromptDataset.stats`, and logged with its line number),
then serves a deterministic, per-epoch shuffled shard for one data-parallel rank. Its
iterator position is a checkpointable state (epoch, position, seed): after
``load_state_dict`` the iterator yields exactly the samples that were still to come, in
the same order.

Schema of a file row (a JSON object per line, or a Parquet row):

- ``prompt``: non-empty string (required);
- ``answer`` (string or number) and/or ``tests`` (a list, object or string): at least one;
- ``metadata``: an object (optional); any other keys are kept in ``metadata`` too.

``gym:<task>`` sources come from reasoning-gym (``size`` samples, seeded by ``seed``);
each sample keeps the gym's entry so that :func:`score` can apply the gym's own checker.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from realscale.errors import UserError

if TYPE_CHECKING:
    from realscale.config import DataConfig

log = logging.getLogger(__name__)

GYM_PREFIX = "gym:"
_MAX_LOGGED_BAD_ROWS = 20  # the count is exact; the log shows the first few only


@dataclass(frozen=True)
class PromptSample:
    """One prompt with what its reward needs."""

    prompt: str
    answer: str | None = None
    tests: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    uid: str = ""  # "<file>:<line>" or "gym:<task>:<index>": stable across runs and ranks


class DatasetError(UserError):
    """A dataset source that cannot be used at all (missing file, unknown gym task ...)."""


# --------------------------------------------------------------------------- row checks


def check_row(row: Any) -> tuple[dict[str, Any] | None, str]:
    """(normalised row, "") for a good row, (None, reason) for a bad one."""
    if not isinstance(row, dict):
        return None, f"expected an object, got {type(row).__name__}"
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return None, "'prompt' missing or not a non-empty string"
    answer, tests = row.get("answer"), row.get("tests")
    if isinstance(answer, bool) or (answer is not None and not isinstance(answer, (str, int, float))):
        return None, f"'answer' must be a string or number, got {type(answer).__name__}"
    if tests is not None and not isinstance(tests, (list, dict, str)):
        return None, f"'tests' must be a list, object or string, got {type(tests).__name__}"
    if answer is None and tests in (None, "", [], {}):
        return None, "needs 'answer' or 'tests'"
    meta = row.get("metadata") or {}
    if not isinstance(meta, dict):
        return None, f"'metadata' must be an object, got {type(meta).__name__}"
    extra = {k: v for k, v in row.items() if k not in ("prompt", "answer", "tests", "metadata")}
    return {"prompt": prompt, "answer": None if answer is None else str(answer), "tests": tests,
            "metadata": {**extra, **meta}}, ""


# --------------------------------------------------------------------------- readers


def read_jsonl(path: str) -> Iterator[tuple[int, Any, str]]:
    """(line number, parsed row or None, parse error) for every non-blank line."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line), ""
            except json.JSONDecodeError as exc:
                yield lineno, None, f"invalid JSON ({exc.msg} at column {exc.colno})"


def read_parquet(path: str) -> Iterator[tuple[int, Any, str]]:
    """(row number from 1, row dict, "") for every Parquet row."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a broken file
        raise DatasetError(f"{path}: not a readable Parquet file ({exc})") from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield i, row, ""


def gym_dataset(task: str, size: int, seed: int, options: dict[str, Any] | None = None) -> Any:
    """reasoning-gym's generator of ``task`` (``size`` problems, seeded; ``options``: its
    settings), or a DatasetError naming what was wrong (not installed, unknown task, bad size
    or settings)."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise DatasetError("reasoning-gym tasks need reasoning-gym (pip install reasoning-gym)") from None
    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(DATASETS)} tasks exist"
        raise DatasetError(f"unknown reasoning-gym task '{task}'{hint}")
    if size < 1:
        raise DatasetError(f"gym:{task}: size must be >= 1, got {size}")
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **(options or {}))
    except (TypeError, ValueError, AssertionError) as exc:  # the gym's config checks raise these
        raise DatasetError(f"reasoning-gym {task} refused the settings {options}: {exc}") from None


def _gym_rows(task: str, size: int, seed: int) -> list[PromptSample]:
    data = gym_dataset(task, size, seed)
    out = []
    for i in range(size):
        entry = data[i]
        meta = {"gym_task": task, "gym_entry": entry}
        out.append(PromptSample(prompt=entry["question"], answer=str(entry["answer"]), metadata=meta,
                                uid=f"gym:{task}:{i}"))
    return out


# --------------------------------------------------------------------------- the dataset


class PromptDataset:
    """Prompts for one dp rank, deterministic per (seed, epoch), resumable exactly.

    Args:
        source: a ``.jsonl``/``.json`` or ``.parquet`` path, or ``gym:<task>``.
        size: samples to generate (gym sources only).
        seed: seeds the shuffle (and the gym generator).
        shuffle: reshuffle every epoch; off: file order.
        rank, world: this rank's shard of ``world`` data-parallel ranks. Every rank gets
            ``len(all) // world`` samples per epoch (lockstep ranks need equal counts); the
            few left over rotate with the shuffle, so none is dropped for good.
        num_epochs: epochs to iterate (None: forever).
        max_prompt_tokens, prompt_len: skip (and count) prompts whose ``prompt_len`` is
            above the limit; ``prompt_len`` is e.g. a tokenizer's length function.
    """

    def __init__(self, source: str, *, size: int = 0, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world: int = 1, num_epochs: int | None = None, max_prompt_tokens: int | None = None,
                 prompt_len: Callable[[str], int] | None = None) -> None:
        if world < 1 or not 0 <= rank < world:
            raise DatasetError(f"rank {rank} is not in [0, world={world})")
        if num_epochs is not None and num_epochs < 0:
            raise DatasetError(f"num_epochs must be >= 0 or None, got {num_epochs}")
        self.source, self.seed, self.shuffle = source, int(seed), shuffle
        self.rank, self.world, self.num_epochs = rank, world, num_epochs
        self._skipped: Counter[str] = Counter()
        self._rows = 0
        samples = self._load(source, size)
        if max_prompt_tokens is not None:
            if prompt_len is None:
                raise DatasetError("max_prompt_tokens needs prompt_len (e.g. a tokenizer's length function)")
            kept = [s for s in samples if prompt_len(s.prompt) <= max_prompt_tokens]
            if len(kept) < len(samples):
                self._skipped[f"prompt longer than {max_prompt_tokens} tokens"] += len(samples) - len(kept)
            samples = kept
        self.samples: list[PromptSample] = samples
        if len(samples) < world:
            raise DatasetError(f"{source}: {len(samples)} usable samples for {world} ranks "
                               f"({self.stats['skipped']} rows skipped)")
        self.epoch, self.position = 0, 0

    # ----------------------------------------------------------------- loading

    def _load(self, source: str, size: int) -> list[PromptSample]:
        if source.startswith(GYM_PREFIX):
            samples = _gym_rows(source[len(GYM_PREFIX):], size, self.seed)
            self._rows = len(samples)
            return samples
        if not os.path.isfile(source):
            raise DatasetError(f"dataset file not found: {source}")
        ext = os.path.splitext(source)[1].lower()
        if ext in (".jsonl", ".json", ".ndjson"):
            rows = read_jsonl(source)
        elif ext == ".parquet":
            rows = read_parquet(source)
        else:
            raise DatasetError(f"{source}: unknown dataset format '{ext}' (expected .jsonl or .parquet, or gym:<task>)")
        samples = []
        name = os.path.basename(source)
        for lineno, row, error in rows:
            self._rows += 1
            norm, reason = (None, error) if error else check_row(row)
            if norm is None:
                self._skip(source, lineno, reason)
                continue
            samples.append(PromptSample(**norm, uid=f"{name}:{lineno}"))
        return samples

    def _skip(self, source: str, lineno: int, reason: str) -> None:
        total = sum(self._skipped.values())
        self._skipped[reason.split(" (")[0]] += 1
        if total < _MAX_LOGGED_BAD_ROWS:
            log.warning("%s:%d: skipped row: %s", source, lineno, reason)
        elif total == _MAX_LOGGED_BAD_ROWS:
            log.warning("%s: more bad rows; only counting from here on", source)

    # ----------------------------------------------------------------- order

    def __len__(self) -> int:
        """Samples this rank sees per epoch."""
        return len(self.samples) // self.world

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Indices into :attr:`samples` that this rank serves in ``epoch``, in order."""
        n = len(self.samples)
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
        else:
            perm = np.arange(n)
        return perm[: len(self) * self.world][self.rank :: self.world]

    def __iter__(self) -> Iterator[PromptSample]:
        """Samples from the current state on; the state advances as they are yielded."""
        while self.num_epochs is None or self.epoch < self.num_epochs:
            order = self.epoch_order(self.epoch)
            while self.position < len(order):
                sample = self.samples[int(order[self.position])]
                self.position += 1
                yield sample
            self.epoch, self.position = self.epoch + 1, 0

    # ----------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Where the iterator stands; everything :meth:`load_state_dict` checks."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "rank": self.rank, "world": self.world, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``; refuses a state from a different dataset or layout."""
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise DatasetError(f"dataset state lacks {sorted(missing)}")
        for key in ("seed", "shuffle", "rank", "world", "num_samples"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise DatasetError(f"dataset state has {key}={state[key]!r} but this dataset has {mine!r}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise DatasetError(f"dataset state epoch={epoch}, position={position} out of range "
                               f"(epoch length {len(self)})")
        self.epoch, self.position = epoch, position

    @property
    def stats(self) -> dict[str, Any]:
        """Rows read, samples kept, rows skipped (total and by reason)."""
        return {"rows": self._rows, "samples": len(self.samples), "skipped": sum(self._skipped.values()),
                "skipped_by_reason": dict(self._skipped)}


# --------------------------------------------------------------------------- scoring


def score(answer_text: str, sample: PromptSample) -> float:
    """The reasoning-gym task's own score of ``answer_text`` for a gym sample (0..1)."""
    task = sample.metadata.get("gym_task")
    if task is None:
        raise ValueError(f"sample {sample.uid or '?'} is not from a gym: source; score it with the reward module")
    try:
        return float(_gym_scorer(task)(answer=answer_text, entry=sample.metadata["gym_entry"]))
    except Exception as exc:  # noqa: BLE001 - a checker crashing on odd text means "wrong"
        log.warning("gym:%s checker failed on %r (%s); scoring 0", task, answer_text[:80], exc)
        return 0.0


@functools.lru_cache(maxsize=None)
def _gym_scorer(task: str) -> Callable[..., float]:
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)


def from_config(data_cfg: DataConfig, *, seed: int, rank: int = 0, world: int = 1,
                prompt_len: Callable[[str], int] | None = None) -> PromptDataset:
    """The dataset that ``cfg.data`` describes (``seed``: ``cfg.run.seed``). The prompt
    length limit applies when ``prompt_len`` (a tokenizer's length) is given."""
    limit = data_cfg.max_prompt_tokens if prompt_len is not None else None
    return PromptDataset(data_cfg.source, size=data_cfg.size, seed=seed, shuffle=data_cfg.shuffle, rank=rank,
                         world=world, max_prompt_tokens=limit, prompt_len=prompt_len)

"""Two-operand integer arithmetic: the default recipe's task.

A problem is ``a <op> b`` with ``0 <= a, b <= max_operand`` and ``op`` in ``ops``
(``+``, ``-``; subtraction only with ``a >= b`` so every answer is a plain non-negative
integer). The prompt is the bare expression, ``"47+38="``; the answer is the number,
``"85"``. Every problem of the space is enumerated in a fixed order and permuted once by
``seed``: the first ``heldout_size`` are the held-out split, the rest the training split.
Splits are therefore disjoint and identical on every machine and run with that seed.

Token layout, shared by SFT, the RL workflow and evaluation (so an answer learnt in SFT is
what the RL reward and the evaluator extract):

- prompt: the tokenizer's chat template over one user message with
  ``add_generation_prompt=True`` (``<|im_start|>user\\n47+38=<|im_end|>\\n<|im_start|>assistant\\n``);
- completion: the answer's tokens then the EOS token (``85<|endoftext|>``). The generation
  servers stop on the model's EOS, and the math reward takes the final number.

Worked answers: an addition can also be answered by working it column by column first,
``"47+38="`` -> ``"(7+8=15,4+3+1=8)85"``. The SFT warm start can mix the two styles
(``data.task_worked_fraction``); the final number is the answer either way, so the reward
does not care which style the policy uses — only whether the number is right. Working
pays on this task (each column is a one-digit sum a tiny model learns quickly), and the
default recipe's RL stage is there to find that out. Subtractions are always answered
directly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from realscale.data.tokens import Tokenizer, observation_ids
from realscale.data.tokens import prompt_ids as workflow_prompt_ids
from realscale.reward.math_extract import extract_answer
from realscale.reward.math_fast import fast_check
from realscale.tasks.long_tail import LongTailTask

if TYPE_CHECKING:
    from realscale.config import DataConfig

TASK_PREFIX = "task:"
OPS = ("+", "-")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem."""

    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b if self.op == "+" else self.a - self.b)

    def worked(self) -> str:
        """The answer worked column by column, least significant first:
        ``47+38`` -> ``"(7+8=15,4+3+1=8)85"``; the direct answer for a subtraction."""
        if self.op != "+":
            return self.answer
        a, b, carry, cols = self.a, self.b, 0, []
        while True:
            da, db = a % 10, b % 10
            total = da + db + carry
            cols.append(f"{da}+{db}={total}" if not cols else f"{da}+{db}+{carry}={total}")
            a, b, carry = a // 10, b // 10, total // 10
            if a == 0 and b == 0:
                break
        return "(" + ",".join(cols) + ")" + self.answer

    @property
    def metadata(self) -> dict[str, Any]:
        return {"task": "arith", "a": self.a, "op": self.op, "b": self.b}


@dataclass(frozen=True)
class ArithTask:
    """The problem space and its seeded train / held-out split."""

    max_operand: int = 29
    ops: str = "+"
    heldout_size: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"arith task: max_operand must be >= 1, got {self.max_operand}")
        bad = [op for op in self.ops if op not in OPS]
        if not self.ops or bad:
            raise ValueError(f"arith task: ops must be a non-empty string of {''.join(OPS)!r}, got {self.ops!r}")
        total = len(self.all_problems())
        if not 0 < self.heldout_size < total:
            raise ValueError(f"arith task: heldout_size must be in 1..{total - 1} (the space has {total} "
                             f"problems), got {self.heldout_size}")

    def all_problems(self) -> list[Problem]:
        """Every problem of the space, in a fixed order (ops, then a, then b)."""
        n = self.max_operand + 1
        out = []
        for op in dict.fromkeys(self.ops):  # dedupe, keep order: "++" is the same space as "+"
            out += [Problem(a, op, b) for a in range(n) for b in range(n) if op == "+" or a >= b]
        return out

    def split(self, name: str) -> list[Problem]:
        """``"train"`` or ``"heldout"``: disjoint, deterministic given ``seed``."""
        if name not in ("train", "heldout"):
            raise ValueError(f"arith task: split must be 'train' or 'heldout', got {name!r}")
        problems = self.all_problems()
        order = np.random.default_rng(self.seed).permutation(len(problems))
        picked = order[: self.heldout_size] if name == "heldout" else order[self.heldout_size:]
        return [problems[i] for i in picked]


TASKS: tuple[str, ...] = ("arith", "long_tail")  # names after "task:" in data.source


def task_from_config(data_cfg: DataConfig) -> Any:
    """The task a :class:`realscale.config.DataConfig` describes: ``task:long_tail`` selects
    :class:`realscale.tasks.long_tail.LongTailTask`, anything else the arithmetic task (its
    ``task_*`` knobs). Every task has ``split(name)`` -> problems with ``prompt``,
    ``answer`` (the direct answer), ``worked()`` (the worked answer) and ``metadata``."""
    if data_cfg.source == TASK_PREFIX + "long_tail":
        return LongTailTask.from_config(data_cfg)
    return ArithTask(max_operand=data_cfg.task_max_operand, ops=data_cfg.task_ops,
                     heldout_size=data_cfg.task_heldout, seed=data_cfg.task_seed)


def write_jsonl(problems: list[Any], path: str) -> str:
    """Rows ``{"prompt", "answer", "metadata"}`` (the PromptDataset schema), written atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for p in problems:
            row = {"prompt": p.prompt, "answer": p.answer, "metadata": p.metadata}
            fh.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


def resolve_task_source(source: str, task: Any, out_dir: str, split: str = "train") -> str:
    """``task:<name>`` -> ``<out_dir>/<name>-<split>.jsonl`` (written now); any other source unchanged.

    The RL trainer calls this on ``data.source`` so the existing JSONL reader serves the
    task: no second dataset code path.
    """
    if not source.startswith(TASK_PREFIX):
        return source
    name = source[len(TASK_PREFIX):]
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} in data.source {source!r}; known: {', '.join(TASKS)}")
    return write_jsonl(task.split(split), os.path.join(out_dir, f"{name}-{split}.jsonl"))


# --------------------------------------------------------------------------- tokens


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt as the RL workflow sends it (one definition: the workflow's)."""

    return workflow_prompt_ids(tokenizer, prompt)


def encode_example(tokenizer: Tokenizer, problem: Problem, worked: bool = False) -> tuple[list[int], list[float]]:
    """(token ids, loss mask) of prompt + answer + EOS; the mask is 1 on answer and EOS tokens.
    ``worked``: the column-by-column answer (:meth:`Problem.worked`) instead of the bare number.

    The mask follows the engine's log-prob alignment (``logp[j]`` predicts token ``j``),
    so it marks exactly the tokens the model must produce after the prompt.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; the answer could never end")
    head = prompt_ids(tokenizer, problem.prompt)
    text = problem.worked() if worked else problem.answer
    tail = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    tail.append(int(tokenizer.eos_token_id))
    return head + tail, [0.0] * len(head) + [1.0] * len(tail)


def encode_tool_example(tokenizer: Tokenizer, problem: Any, use_tool: bool = True) -> tuple[list[int], list[float]]:
    """(token ids, loss mask) of a multi-turn demonstration for the calculator environment
    (:class:`realscale.rollout.workflows.CalculatorEnv`), laid out exactly as the
    multi-turn workflow lays out an episode. With ``use_tool``: the model asks
    ``<calc>47+38</calc>``, the tool answers ``<result>85</result>`` (mask 0), the model
    answers ``<answer>85</answer>``; without: the model answers at once. Every model
    turn ends with EOS, as the servers return it."""

    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; the answer could never end")
    eos = int(tokenizer.eos_token_id)

    def turn(text: str) -> list[int]:
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]] + [eos]

    head = prompt_ids(tokenizer, problem.prompt)
    ids, mask = list(head), [0.0] * len(head)
    if use_tool:
        call, obs = turn(f"<calc>{problem.prompt.rstrip('=')}</calc>"), observation_ids(tokenizer,
                                                                                       f"<result>{problem.answer}</result>")
        ids += call + obs
        mask += [1.0] * len(call) + [0.0] * len(obs)
    answer = turn(f"<answer>{problem.answer}</answer>")
    return ids + answer, mask + [1.0] * len(answer)


def is_correct(completion: str, reference: str) -> bool:
    """The RL reward's verdict, in process: final answer extracted as the math reward does,
    compared exactly. Answers of this task are integers, which the reward's fast path
    always decides; anything it cannot decide is not an integer, hence wrong."""

    found = extract_answer(completion)
    if found is None:
        return False
    return bool(fast_check(reference, found[0]))

"""Accuracy of a model directory on the task's held-out split.

Generation goes through the embedded generation engine (the same continuous-batching
engine ``realscale serve`` runs), in process: no HTTP hop, same tokens. Prompts are laid
out as the RL workflow lays them out (:func:`realscale.tasks.arith.prompt_ids`) and an
answer is judged as the RL reward judges it (:func:`realscale.tasks.arith.is_correct`).

Greedy decoding (temperature 0) gives *the* accuracy; sampling with ``samples > 1``
additionally reports how many prompts get a mix of right and wrong answers, which is what
GRPO needs for non-zero advantages.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from realscale.tasks.arith import Problem, is_correct, prompt_ids

if TYPE_CHECKING:
    from realscale.config import Config


@dataclass
class EvalResult:
    """Scores of one evaluation; ``accuracy`` is over every sample, ``pass_at_k`` over prompts."""

    accuracy: float
    num_prompts: int
    samples_per_prompt: int
    temperature: float
    pass_at_k: float  # a prompt counts when any of its samples is right
    mixed_fraction: float  # prompts with both right and wrong samples (0 when samples == 1)
    seconds: float
    examples: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        text = f"accuracy {self.accuracy:.3f} on {self.num_prompts} prompts"
        if self.samples_per_prompt > 1:
            text += (f" x {self.samples_per_prompt} samples at T={self.temperature:g}: pass@{self.samples_per_prompt} "
                     f"{self.pass_at_k:.3f}, mixed groups {self.mixed_fraction:.3f}")
        return text + f" ({self.seconds:.1f} s)"


def generate_completions(model_dir: str, prompts: list[list[int]], *, samples: int = 1, temperature: float = 0.0,
                         max_new_tokens: int = 8, seed: int = 0, max_running: int = 64) -> list[list[str]]:
    """``samples`` decoded completions per prompt from the embedded generation engine."""
    from realscale.generate.engine import Request, SamplingOptions
    from realscale.generate.server import EmbeddedServer

    longest = max(len(p) for p in prompts) + max_new_tokens + 1
    server = EmbeddedServer(model_dir, max_running=max_running, context_length=max(longest, 64), seed=seed)
    try:
        futures = []
        for ids in prompts:
            for _ in range(samples):
                opts = SamplingOptions(max_new_tokens=max_new_tokens, temperature=temperature)
                futures.append(server.engine.submit(Request(rid=uuid.uuid4().hex, input_ids=list(ids), params=opts)))
        texts = [server.tokenizer.decode(f.result().output_ids, skip_special_tokens=True) for f in futures]
    finally:
        server.engine.shutdown()
        server.pool.shutdown(wait=False)
    return [texts[i * samples:(i + 1) * samples] for i in range(len(prompts))]


def evaluate(model_dir: str, problems: list[Problem], *, samples: int = 1, temperature: float = 0.0,
             max_new_tokens: int = 8, seed: int = 0, keep_examples: int = 8) -> EvalResult:
    """Score ``model_dir`` on ``problems`` (greedy by default)."""
    from transformers import AutoTokenizer

    from realscale.models.tiny import resolve_model_path

    if not problems:
        raise ValueError("evaluate: no problems given")
    if samples < 1:
        raise ValueError(f"evaluate: samples must be >= 1, got {samples}")
    start = time.perf_counter()
    model_dir = resolve_model_path(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [prompt_ids(tok, p.prompt) for p in problems]
    outs = generate_completions(model_dir, prompts, samples=samples, temperature=temperature,
                                max_new_tokens=max_new_tokens, seed=seed)
    verdicts = [[is_correct(text, p.answer) for text in group] for p, group in zip(problems, outs)]
    flat = [v for group in verdicts for v in group]
    examples = [{"prompt": p.prompt, "answer": p.answer, "completions": group}
                for p, group in zip(problems[:keep_examples], outs)]
    return EvalResult(
        accuracy=sum(flat) / len(flat), num_prompts=len(problems), samples_per_prompt=samples,
        temperature=temperature, pass_at_k=sum(any(g) for g in verdicts) / len(verdicts),
        mixed_fraction=sum(any(g) and not all(g) for g in verdicts) / len(verdicts),
        seconds=time.perf_counter() - start, examples=examples)


def write_result(result: EvalResult, path: str) -> str:
    """The result as JSON (for run directories and benchmarks)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(asdict(result), fh, indent=2)
    return path


def evaluate_heldout(cfg: Config, model_dir: str) -> dict[str, float] | None:
    """Accuracy on the task's held-out split: greedy, and sampled at the run's temperature
    (4 samples per prompt: the policy RL trains). None for sources without a split."""
    if not cfg.data.source.startswith("task:"):
        return None
    from realscale.tasks.arith import task_from_config

    problems = task_from_config(cfg.data).split("heldout")
    greedy = evaluate(model_dir, problems, max_new_tokens=cfg.generate.max_new_tokens)
    sampled = evaluate(model_dir, problems, samples=4, temperature=cfg.generate.temperature,
                       max_new_tokens=cfg.generate.max_new_tokens, seed=cfg.run.seed)
    return {"greedy": greedy.accuracy, "sampled": sampled.accuracy, "pass@4": sampled.pass_at_k}

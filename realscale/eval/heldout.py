"""Accuracy of a model directory on the task's held-out split.

Generation goes through the embedded generation engine (the same continuous-batching
engine ``realscale serve`` runs), in process: no HTTP hop, same tokens. Prompts are laid
out as the RL workflow lays them out (:func:`realscale.tasks.arith.prompt_ids`) and an
answer is judged as the RL reward judges it (:func:`realscale.tasks.arith.is_correct`).

With ``rollout.workflow: multi_turn`` an evaluation is a multi-turn episode with the
calculator tool, run by the RL workflow itself over the in-process engine, and scored
by the environment.

Greedy decoding (temperature 0) gives *the* accuracy; sampling with ``samples > 1``
additionally reports how many prompts get a mix of right and wrong answers, which is what
GRPO needs for non-zero advantages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from realscale.data.dataset import PromptSample
from realscale.eval.benchmark import run_benchmark, settings_from_config
from realscale.inference.client import GenerateResult
from realscale.models.tiny import resolve_model_path
from realscale.models.tokenizer import load_light_tokenizer
from realscale.rollout.workflows import CalculatorEnv, MultiTurnWorkflow
from realscale.tasks.arith import Problem, is_correct, prompt_ids, task_from_config

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.data.tokens import Tokenizer
    from realscale.serve.engine import Engine


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
    tool_use: float | None = None  # multi-turn: share of episodes in which the calculator answered
    examples: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        text = f"accuracy {self.accuracy:.3f} on {self.num_prompts} prompts"
        if self.samples_per_prompt > 1:
            text += (f" x {self.samples_per_prompt} samples at T={self.temperature:g}: pass@{self.samples_per_prompt} "
                     f"{self.pass_at_k:.3f}, mixed groups {self.mixed_fraction:.3f}")
        if self.tool_use is not None:
            text += f", calculator used in {self.tool_use:.3f} of episodes"
        return text + f" ({self.seconds:.1f} s)"


@contextlib.contextmanager
def _embedded(model_dir: str, context_length: int, seed: int, max_running: int = 64) -> Iterator[Any]:
    """An in-process embedded server (engine + tokenizer), shut down afterwards."""
    from realscale.serve.server import EmbeddedServer

    server = EmbeddedServer(model_dir, max_running=max_running, context_length=max(context_length, 64), seed=seed)
    try:
        yield server
    finally:
        server.close()


def generate_completions(model_dir: str, prompts: list[list[int]], *, samples: int = 1, temperature: float = 0.0,
                         max_new_tokens: int = 8, seed: int = 0, max_running: int = 64,
                         tokenizer: Tokenizer | None = None) -> list[list[str]]:
    """``samples`` decoded completions per prompt from the embedded generation engine
    (decoded with ``tokenizer``; default: the model directory's)."""
    from realscale.serve.engine import Request, SamplingOptions

    longest = max(len(p) for p in prompts) + max_new_tokens + 1
    with _embedded(model_dir, longest, seed, max_running) as server:
        futures = []
        for ids in prompts:
            for _ in range(samples):
                opts = SamplingOptions(max_new_tokens=max_new_tokens, temperature=temperature)
                futures.append(server.engine.submit(Request(rid=uuid.uuid4().hex, input_ids=list(ids), params=opts)))
        tok = tokenizer or server.tokenizer
        texts = [tok.decode(f.result().output_ids, skip_special_tokens=True) for f in futures]
    return [texts[i * samples:(i + 1) * samples] for i in range(len(prompts))]


class _EngineClient:
    """The workflows' client interface (``generate(ids, params)``) over an in-process engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def generate(self, ids: list[int], params: dict[str, Any]) -> GenerateResult:
        from realscale.serve.engine import Request, SamplingOptions

        opts = SamplingOptions(max_new_tokens=int(params["max_new_tokens"]), temperature=float(params["temperature"]))
        done = await asyncio.wrap_future(self.engine.submit(Request(uuid.uuid4().hex, list(ids), opts,
                                                                    return_logprob=True)))
        n = len(done.output_ids)
        return GenerateResult(list(ids), list(done.output_ids), list(done.logprobs), [0] * n, done.finish_reason or {})


def run_tool_episodes(model_dir: str, tok: Tokenizer, problems: list[Problem], *, samples: int, temperature: float,
                      max_new_tokens: int, max_turns: int, seed: int) -> list[list[Any]]:
    """``samples`` multi-turn episodes per problem with the calculator environment, through
    :class:`realscale.rollout.workflows.MultiTurnWorkflow` itself (the RL rollouts' code)."""

    context = max(len(prompt_ids(tok, p.prompt)) for p in problems) + max_turns * (max_new_tokens + 64)
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    with _embedded(model_dir, context, seed) as server:
        wf = MultiTurnWorkflow(tok, samples, params, CalculatorEnv, max_turns, max_total_tokens=context)
        client = _EngineClient(server.engine)

        async def episodes() -> list[list[Any]]:
            return await asyncio.gather(*[wf.run_episode(client, PromptSample(p.prompt, p.answer, uid=str(i)))
                                          for i, p in enumerate(problems)])
        return asyncio.run(episodes())


def evaluate(model_dir: str, problems: list[Problem], *, samples: int = 1, temperature: float = 0.0,
             max_new_tokens: int = 8, seed: int = 0, keep_examples: int = 8, tokenizer_dir: str = "",
             max_turns: int = 0) -> EvalResult:
    """Score ``model_dir`` on ``problems`` (greedy by default); prompts are encoded and
    answers decoded with the tokenizer in ``tokenizer_dir`` (``model.tokenizer``; empty:
    the model directory's). ``max_turns > 0``: multi-turn episodes with the calculator
    tool (``rollout.workflow: multi_turn``), scored by the environment, and the share of
    episodes in which the calculator returned a result (``tool_use``)."""
    if not problems:
        raise ValueError("evaluate: no problems given")
    if samples < 1:
        raise ValueError(f"evaluate: samples must be >= 1, got {samples}")
    start = time.perf_counter()
    model_dir = resolve_model_path(model_dir)
    tok = load_light_tokenizer(tokenizer_dir or model_dir)
    tool_use = None
    if max_turns:
        groups = run_tool_episodes(model_dir, tok, problems, samples=samples, temperature=temperature,
                                   max_new_tokens=max_new_tokens, max_turns=max_turns, seed=seed)
        outs = [[t.completion_text for t in g] for g in groups]
        verdicts = [[t.reward > 0.5 for t in g] for g in groups]
        used = [t for g in groups for t in g if "<result>" in t.completion_text]
        tool_use = len(used) / sum(len(g) for g in groups)
    else:
        prompts = [prompt_ids(tok, p.prompt) for p in problems]
        outs = generate_completions(model_dir, prompts, samples=samples, temperature=temperature,
                                    max_new_tokens=max_new_tokens, seed=seed, tokenizer=tok)
        verdicts = [[is_correct(text, p.answer) for text in group] for p, group in zip(problems, outs)]
    flat = [v for group in verdicts for v in group]
    examples = [{"prompt": p.prompt, "answer": p.answer, "completions": group}
                for p, group in zip(problems[:keep_examples], outs)]
    return EvalResult(
        accuracy=sum(flat) / len(flat), num_prompts=len(problems), samples_per_prompt=samples,
        temperature=temperature, pass_at_k=sum(any(g) for g in verdicts) / len(verdicts),
        mixed_fraction=sum(any(g) and not all(g) for g in verdicts) / len(verdicts),
        seconds=time.perf_counter() - start, tool_use=tool_use, examples=examples)


def write_result(result: EvalResult, path: str) -> str:
    """The result as JSON (for run directories and benchmarks)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(asdict(result), fh, indent=2)
    return path


def evaluate_heldout(cfg: Config, model_dir: str, out_dir: str = "",
                     urls: list[str] | None = None) -> dict[str, float] | None:
    """A run's before/after evaluation. With ``eval.data`` set: the benchmark's pass@k /
    avg@n / maj@n through generation servers (records under ``out_dir``). Otherwise, for
    task sources, accuracy on the task's held-out split: greedy, and sampled at the run's
    temperature (4 samples per prompt: the policy RL trains). None for other sources.
    ``urls``: the servers of ``model_dir`` that the benchmark samples from (``eval.data``)."""
    if cfg.eval.data:
        result = run_benchmark(cfg, model_dir, settings_from_config(cfg), out_dir or os.path.join(model_dir, "eval"),
                               urls or [])
        print(result.table(), flush=True)
        return result.metrics
    if not cfg.data.source.startswith("task:"):
        return None

    problems = task_from_config(cfg.data).split("heldout")
    common = {"max_new_tokens": cfg.generate.max_new_tokens, "tokenizer_dir": cfg.model.tokenizer,
              "max_turns": cfg.rollout.max_turns if cfg.rollout.workflow == "multi_turn" else 0}
    greedy = evaluate(model_dir, problems, **common)
    sampled = evaluate(model_dir, problems, samples=4, temperature=cfg.generate.temperature, seed=cfg.run.seed,
                       **common)
    out = {"greedy": greedy.accuracy, "sampled": sampled.accuracy, "pass@4": sampled.pass_at_k}
    if sampled.tool_use is not None:
        out.update({"tool_use_greedy": greedy.tool_use, "tool_use_sampled": sampled.tool_use})
    return out

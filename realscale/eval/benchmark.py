"""``realscale eval``: a model on a benchmark, through the generation tier of training.

A benchmark is a recipe-format file (JSONL / Parquet: ``prompt`` + ``answer`` or
``tests``; see ``realscale data convert``) or a toy task (``task:arith``: its held-out
split). For every problem, ``n`` answers are sampled with the papers' settings
(temperature, top-p, most new tokens), each scored by the same reward function RL uses
(:func:`realscale.rollout.rewards.reward_fn_for`: the math reward, or the code sandbox for
rows with tests). The scores are pass@k (unbiased), avg@n and maj@n
(:mod:`realscale.eval.metrics`).

Generation goes through HTTP generation servers with the same client as the rollouts
(:class:`realscale.inference.client.InferenceClient`: least-load routing, resends):
servers that already run (``urls``: embedded, SGLang, vLLM). ``realscale eval`` and the
supervisor start servers for an evaluation when none are given
(:func:`realscale.launcher.served`: ``generate.num_servers`` embedded servers on this
machine, or job steps inside a Slurm allocation) and stop them after it. Prompts are
laid out as the RL workflow lays them out: the model's chat template when it has one,
the bare prompt text otherwise.

Outputs: ``per_problem.jsonl`` (each problem's completions, verdicts, extracted answers,
its pass@k) and ``summary.json`` in the output directory, and a printed table.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from realscale.data.dataset import PromptDataset, PromptSample
from realscale.data.tokens import prompt_ids
from realscale.eval.metrics import aggregate, answer_key, paired_difference, pass_at_k
from realscale.inference.client import InferenceClient
from realscale.models.tiny import resolve_model_path
from realscale.models.tokenizer import load_tokenizer
from realscale.reward.math_extract import extract_answer
from realscale.rollout.controller import client_kwargs, connections_per_server
from realscale.rollout.rewards import call_reward, close_reward_pools, reward_fn_for
from realscale.tasks.arith import task_from_config

if TYPE_CHECKING:
    from realscale.config import Config
    from realscale.data.dataset import PromptSample
    from realscale.data.tokens import Tokenizer


@dataclass
class BenchmarkSettings:
    """How a benchmark is sampled (``eval`` section of the config, or ``realscale eval`` flags)."""

    data: str
    samples: int = 4
    ks: tuple[int, ...] = (1,)
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 512
    max_problems: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"eval: samples must be >= 1, got {self.samples}")
        bad = [k for k in self.ks if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"eval: pass@k needs 1 <= k <= samples ({self.samples}), got k={bad[0]}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1 or self.max_problems < 0:
            raise ValueError("eval: temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 1, max_problems >= 0")


@dataclass
class BenchmarkResult:
    """Scores of one evaluation, and where its per-problem records are."""

    model: str
    data: str
    num_problems: int
    samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    metrics: dict[str, float]
    seconds: float
    output_tokens: int
    truncated: float  # fraction of answers that hit max_new_tokens
    reward_reasons: dict[str, int] = field(default_factory=dict)
    per_problem: str = ""
    inflight_peak: int = 0  # most requests in flight at once, in all
    inflight_server_peak: int = 0  # ... on one server

    def table(self) -> str:
        rows = [("model", self.model), ("data", f"{self.data} ({self.num_problems} problems)"),
                ("sampling", f"n={self.samples}, T={self.temperature:g}, top-p={self.top_p:g}, "
                             f"max {self.max_new_tokens} new tokens")]
        rows += [(name, f"{100 * value:.1f}%" + (f" ± {100 * self.metrics[name + '_ci95']:.1f}% (95%)"
                                                  if name + "_ci95" in self.metrics else ""))
                 for name, value in self.metrics.items() if not name.endswith("_ci95")]
        rows += [("answers cut at max tokens", f"{100 * self.truncated:.1f}%"),
                 ("tokens generated", f"{self.output_tokens} in {self.seconds:.0f} s "
                                      f"({self.output_tokens / max(self.seconds, 1e-9):.0f} tok/s)"),
                 ("requests in flight (peak)", f"{self.inflight_peak} in all, {self.inflight_server_peak} on one server")]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# --------------------------------------------------------------------------- problems and prompts


def load_problems(data: str, cfg: "Config", max_problems: int = 0) -> list["PromptSample"]:
    """The benchmark's problems: a recipe-format file, or ``task:<name>``'s held-out split."""

    if data.startswith("task:"):
        task = task_from_config(replace(cfg.data, source=data))
        problems = [PromptSample(prompt=p.prompt, answer=p.answer, metadata=p.metadata, uid=f"{data}:{i}")
                    for i, p in enumerate(task.split("heldout"))]
    else:
        problems = list(PromptDataset(data, shuffle=False, num_epochs=1).samples)
    if not problems:
        raise ValueError(f"eval: {data} holds no usable problem")
    return problems[:max_problems] if max_problems else problems


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The RL workflow's prompt layout (chat template), or the bare text for a model without one."""
    if getattr(tokenizer, "chat_template", None):
        return prompt_ids(tokenizer, prompt)
    return list(tokenizer.encode(prompt))


# --------------------------------------------------------------------------- generation and scoring


# requests in flight per server when the server sets its own limit (generate.max_running_requests
# = 0: SGLang, vLLM): a decode batch of 256 and as many waiting in its queue, within a
# process's default 1,024 open files for a few servers
EVAL_PER_SERVER = 512


def eval_concurrency(cfg: "Config", servers: int) -> int:
    """Requests the evaluation keeps in flight: each server's share as the rollouts'
    (``connections_per_server``: twice its decode slots), or ``EVAL_PER_SERVER`` when the
    server sets its own limit."""
    return (connections_per_server(cfg.generate) or EVAL_PER_SERVER) * servers


async def _sample_all(urls: list[str], prompts: list[list[int]], settings: BenchmarkSettings,
                      cfg: "Config") -> tuple[list[list[Any]], tuple[int, int]]:
    """``samples`` generations per prompt through the run's client (its backend's dialect,
    per-server connection cap and request time limits), at most :func:`eval_concurrency`
    in flight. Returns the results and the peak requests in flight (in all, on one server)."""

    params = {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
              "top_p": settings.top_p}
    gate = asyncio.Semaphore(eval_concurrency(cfg, len(urls)))
    # evaluation trains nothing: no routed experts to replay
    async with InferenceClient(urls, **{**client_kwargs(cfg), "routed_experts": False}) as client:
        async def one(ids: list[int]) -> Any:
            async with gate:
                return await client.generate(ids, dict(params))

        tasks = [[asyncio.ensure_future(one(ids)) for _ in range(settings.samples)] for ids in prompts]
        results = [[await t for t in group] for group in tasks]
        return results, client.take_peaks()


async def _score_all(cfg: "Config", problems: list["PromptSample"], texts: list[list[str]]) -> list[list[Any]]:
    async def group(sample: "PromptSample", outs: list[str]) -> list[Any]:
        fn = reward_fn_for(cfg.reward, sample)
        return list(await asyncio.gather(*(call_reward(fn, sample.prompt, t, sample,
                                                       timeout=cfg.rollout.reward_timeout) for t in outs)))

    return list(await asyncio.gather(*(group(p, t) for p, t in zip(problems, texts))))


def _extracted(sample: "PromptSample", text: str) -> str | None:
    if sample.answer is None:
        return None  # code problems: no answer to vote on

    found = extract_answer(text)
    return found[0] if found else None


# --------------------------------------------------------------------------- the evaluation


def run_benchmark(cfg: "Config", model_dir: str, settings: BenchmarkSettings, out_dir: str,
                  urls: list[str]) -> BenchmarkResult:
    """Evaluate ``model_dir``, served at ``urls``, on ``settings.data``; write per-problem
    records and the summary into ``out_dir``. (Whoever calls starts the servers:
    ``realscale eval`` and the supervisor through :func:`realscale.launcher.served`.)"""
    model_dir = resolve_model_path(model_dir)
    problems = load_problems(settings.data, cfg, settings.max_problems)
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_dir)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    os.makedirs(out_dir, exist_ok=True)
    if not urls:
        raise ValueError("realscale eval: no generation server to evaluate with (give --servers, or let it start some)")
    start = time.perf_counter()
    results, peaks = asyncio.run(_sample_all(urls, prompts, settings, cfg))
    texts = [[tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in group] for group in results]
    try:
        verdicts = asyncio.run(_score_all(cfg, problems, texts))
    finally:
        close_reward_pools()
    seconds = time.perf_counter() - start
    return _finish(model_dir, problems, results, texts, verdicts, settings, seconds, out_dir, peaks)


def _finish(model_dir: str, problems: list["PromptSample"], results: list[list[Any]], texts: list[list[str]],
            verdicts: list[list[Any]], settings: BenchmarkSettings, seconds: float,
            out_dir: str, peaks: tuple[int, int]) -> BenchmarkResult:
    correct = [[v.value > 0.5 for v in group] for group in verdicts]
    keys = [[answer_key(_extracted(p, t)) for t in group] for p, group in zip(problems, texts)]
    with_answers = all(p.answer is not None for p in problems)
    metrics = aggregate(correct, keys if with_answers else None, settings.ks)
    per_problem = os.path.join(out_dir, "per_problem.jsonl")
    reasons: dict[str, int] = {}
    truncated = tokens = 0
    with open(per_problem, "w", encoding="utf-8") as fh:
        for p, res, outs, verd, cor, kk in zip(problems, results, texts, verdicts, correct, keys):
            for v in verd:
                reasons[v.reason] = reasons.get(v.reason, 0) + 1
            truncated += sum(r.finish_reason.get("type") == "length" for r in res)
            tokens += sum(len(r.output_ids) for r in res)
            fh.write(json.dumps({
                "uid": p.uid, "prompt": p.prompt, "answer": p.answer, "completions": outs, "correct": cor,
                "extracted": kk, "num_correct": sum(cor),
                "pass@k": {str(k): pass_at_k(len(cor), sum(cor), k) for k in settings.ks},
                "output_tokens": [len(r.output_ids) for r in res],
                "finish_reasons": [r.finish_reason.get("type") for r in res],
            }, ensure_ascii=False) + "\n")
    n_answers = len(problems) * settings.samples
    result = BenchmarkResult(model=model_dir, data=settings.data, num_problems=len(problems),
                             samples=settings.samples, temperature=settings.temperature, top_p=settings.top_p,
                             max_new_tokens=settings.max_new_tokens, metrics=metrics, seconds=seconds,
                             output_tokens=tokens, truncated=truncated / n_answers, reward_reasons=reasons,
                             per_problem=per_problem, inflight_peak=peaks[0], inflight_server_peak=peaks[1])
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(asdict(result), fh, indent=1)
    return result


def read_per_problem(out_dir: str) -> dict[str, list[bool]] | None:
    """``uid -> verdicts`` from an evaluation's ``per_problem.jsonl`` (None when there is none)."""
    path = os.path.join(out_dir, "per_problem.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return {row["uid"]: row["correct"] for row in map(json.loads, fh)}


def per_problem_accuracy(out_dir: str) -> dict[str, float] | None:
    """``uid -> fraction of its answers judged right`` from an evaluation's records (None when there are none)."""
    verdicts = read_per_problem(out_dir)
    return None if verdicts is None else {uid: sum(v) / len(v) for uid, v in verdicts.items()}


def paired_change(before_dir: str, after_dir: str) -> tuple[str, float, float] | None:
    """``("avg@n", after - before, 95% half-width)`` of two evaluations of the same problems,
    paired per problem (:func:`realscale.eval.metrics.paired_difference`); None unless both
    evaluations exist and scored the same problems with the same n."""
    before, after = read_per_problem(before_dir), read_per_problem(after_dir)
    if not before or not after or before.keys() != after.keys():
        return None
    n = {len(v) for v in (*before.values(), *after.values())}
    if len(n) != 1:
        return None
    uids = sorted(before)
    diff, half = paired_difference([sum(before[u]) / len(before[u]) for u in uids],
                                   [sum(after[u]) / len(after[u]) for u in uids])
    return f"avg@{n.pop()}", diff, half


def settings_from_config(cfg: "Config", data: str | None = None) -> BenchmarkSettings:
    """Benchmark settings from the ``eval`` section (``data`` overrides ``eval.data``)."""
    e = cfg.eval
    return BenchmarkSettings(data=data or e.data, samples=e.samples, ks=tuple(e.k), temperature=e.temperature,
                             top_p=e.top_p, max_new_tokens=e.max_new_tokens or cfg.generate.max_new_tokens,
                             max_problems=e.max_problems)

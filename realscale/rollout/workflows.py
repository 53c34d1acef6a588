"""Workflows: how one prompt becomes n scored trajectories.

A :class:`Workflow` has one coroutine, ``run_episode(client, sample) -> list[Trajectory]``,
which samples ``n_samples`` answers concurrently. :class:`SingleTurnWorkflow` is the
plain RL-for-reasoning case: chat template, one generation, reward.
:class:`MultiTurnWorkflow` alternates model turns and environment observations (tool
calls, feedback); only model tokens are trained (``loss_mask`` 1), observation tokens
are context (``loss_mask`` 0, log-prob 0). :class:`CalculatorEnv` is a small built-in
environment: a ``<calc>expr</calc>`` tool and an ``<answer>`` checked against the sample.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import math
import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from realscale._pyast import parse
from realscale.data.dataset import PromptSample
from realscale.data.groups import Trajectory
from realscale.data.tokens import Tokenizer, observation_ids, prompt_ids
from realscale.reward.result import OK, RewardResult
from realscale.rollout.rewards import RewardFn, as_result, call_reward, routed_reward

if TYPE_CHECKING:
    from realscale.config import Config, GenerateConfig
    from realscale.inference.client import GenerateResult

UNKNOWN_VERSION = -1  # a server reported a non-numeric weight version


class GenerateClient(Protocol):
    """What a workflow asks of its client: one generation, to completion. The rollouts'
    :class:`realscale.inference.client.InferenceClient` (HTTP servers), or the held-out
    evaluation's in-process client over the embedded engine (:mod:`realscale.eval.heldout`)."""

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], /) -> GenerateResult: ...


class Workflow(Protocol):
    """Turns one prompt into its group of trajectories."""

    n_samples: int

    async def run_episode(self, client: GenerateClient, sample: PromptSample) -> list[Trajectory]: ...


def _versions(raw: list[Any]) -> list[int]:
    """Per-token versions as ints; the staleness rule needs numbers (SGLang sends strings)."""
    out = []
    for v in raw:
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            out.append(UNKNOWN_VERSION)
    return out


def _finish_type(reason: Any) -> str:
    return str(reason.get("type", "")) if isinstance(reason, dict) else str(reason or "")


def sampling_params_from_config(gen_cfg: GenerateConfig) -> dict[str, Any]:
    """Sampling parameters for the servers from a :class:`realscale.config.GenerateConfig`."""
    return {"max_new_tokens": gen_cfg.max_new_tokens, "temperature": gen_cfg.temperature,
            "top_p": gen_cfg.top_p, "top_k": gen_cfg.top_k}


class _SampledWorkflow:
    """Shared parts: n concurrent samples per prompt, validated settings."""

    def __init__(self, tokenizer: Tokenizer, n_samples: int, sampling_params: dict[str, Any]) -> None:
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"{type(self).__name__}: n_samples must be an int >= 1, got {n_samples!r}")
        if int(sampling_params.get("max_new_tokens", 1)) < 1:
            raise ValueError(f"{type(self).__name__}: max_new_tokens must be >= 1")
        self.tokenizer = tokenizer
        self.n_samples = n_samples
        self.sampling_params = dict(sampling_params)

    async def run_episode(self, client: GenerateClient, sample: PromptSample) -> list[Trajectory]:
        """``n_samples`` trajectories for ``sample``; one failing sample cancels its siblings."""
        ids = prompt_ids(self.tokenizer, sample.prompt)
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._one(client, sample, ids)) for _ in range(self.n_samples)]
        except ExceptionGroup as group:
            # The caller counts failures by type: hand it the first real error, not the wrapper.
            raise group.exceptions[0] from group
        return [t.result() for t in tasks]

    async def _one(self, client: GenerateClient, sample: PromptSample, ids: list[int]) -> Trajectory:
        raise NotImplementedError


class SingleTurnWorkflow(_SampledWorkflow):
    """Chat-templated prompt -> one answer -> reward, ``n_samples`` times.

    ``reward_timeout``: seconds a reward may take before it scores 0 (reason ``timeout``).
    """

    def __init__(self, tokenizer: Tokenizer, n_samples: int, sampling_params: dict[str, Any], reward_fn: RewardFn, *,
                 reward_timeout: float = 30.0) -> None:
        super().__init__(tokenizer, n_samples, sampling_params)
        if reward_timeout <= 0:
            raise ValueError(f"SingleTurnWorkflow: reward_timeout must be > 0, got {reward_timeout!r}")
        self.reward_fn = reward_fn
        self.reward_timeout = float(reward_timeout)

    async def _one(self, client: GenerateClient, sample: PromptSample, ids: list[int]) -> Trajectory:
        res = await client.generate(ids, self.sampling_params)
        text = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        reward = await call_reward(self.reward_fn, sample.prompt, text, sample,
                                   timeout=self.reward_timeout)
        n = len(res.output_ids)
        return Trajectory(prompt_ids=ids, output_ids=list(res.output_ids),
                          output_logprobs=[float(x) for x in res.output_logprobs],
                          output_versions=_versions(res.output_versions), loss_mask=[1] * n,
                          reward=reward.value, reward_reason=reward.reason,
                          finish_reason=_finish_type(res.finish_reason), group_id=sample.uid,
                          prompt_text=sample.prompt, completion_text=text,
                          num_interruptions=res.num_interruptions, routed_experts=res.routed_experts)


# --------------------------------------------------------------------------- multi-turn


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one model turn."""

    observation: str  # shown to the model as the next user/tool turn (ignored when done)
    done: bool


class Environment(Protocol):
    """One episode's environment; methods may be sync or async."""

    def step(self, action: str) -> EnvStep: ...

    def reward(self) -> float | RewardResult: ...


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class MultiTurnWorkflow(_SampledWorkflow):
    """Model turn, environment observation, model turn ... until the env is done or
    ``max_turns`` model turns were taken; the reward is the environment's.

    Observations are rendered as a ``tool`` message in the chat template followed by the
    generation prompt, tokenised and appended with ``loss_mask`` 0. ``max_total_tokens``
    stops the episode before a turn could overrun the server's context.
    ``env_timeout``: seconds one env call may take (a slow env ends the episode with
    reward 0, reason ``timeout``).
    """

    def __init__(self, tokenizer: Tokenizer, n_samples: int, sampling_params: dict[str, Any],
                 env_factory: Callable[[PromptSample], Environment], max_turns: int = 4, *,
                 max_total_tokens: int | None = None, env_timeout: float = 30.0) -> None:
        super().__init__(tokenizer, n_samples, sampling_params)
        if max_turns < 1:
            raise ValueError(f"MultiTurnWorkflow: max_turns must be >= 1, got {max_turns!r}")
        self.env_factory = env_factory
        self.max_turns = int(max_turns)
        self.max_total_tokens = max_total_tokens
        self.env_timeout = float(env_timeout)

    def observation_ids(self, observation: str) -> list[int]:
        return observation_ids(self.tokenizer, observation)

    async def _one(self, client: GenerateClient, sample: PromptSample, ids: list[int]) -> Trajectory:
        env = self.env_factory(sample)
        out: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        mask: list[int] = []
        texts: list[str] = []
        finish, turns, interruptions = "", 0, 0
        budget = int(self.sampling_params.get("max_new_tokens", 128))
        for turns in range(1, self.max_turns + 1):
            res = await client.generate(ids + out, self.sampling_params)
            interruptions += res.num_interruptions
            out += res.output_ids
            lps += [float(x) for x in res.output_logprobs]
            turn_versions = _versions(res.output_versions)
            vers += turn_versions
            mask += [1] * len(res.output_ids)
            finish = _finish_type(res.finish_reason)
            action = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
            texts.append(action)
            try:
                step = await asyncio.wait_for(_maybe_await(env.step(action)), self.env_timeout)
            except asyncio.TimeoutError:
                return self._trajectory(sample, ids, out, lps, vers, mask, texts, turns, finish, interruptions,
                                        RewardResult(0.0, "timeout", "environment step timed out"))
            if step.done or turns == self.max_turns:
                break
            obs = self.observation_ids(step.observation)
            if self.max_total_tokens is not None and len(ids) + len(out) + len(obs) + budget > self.max_total_tokens:
                break  # the next turn would not fit the context
            # Observation tokens inherit the version of the turn before them: they are
            # context, so they must not make the group look older than it is.
            last = turn_versions[-1] if turn_versions else (vers[-1] if vers else UNKNOWN_VERSION)
            out += obs
            lps += [0.0] * len(obs)
            vers += [last] * len(obs)
            mask += [0] * len(obs)
            texts.append(step.observation)
        try:
            reward = as_result(await asyncio.wait_for(_maybe_await(env.reward()), self.env_timeout))
        except asyncio.TimeoutError:
            reward = RewardResult(0.0, "timeout", "environment reward timed out")
        return self._trajectory(sample, ids, out, lps, vers, mask, texts, turns, finish, interruptions, reward)

    @staticmethod
    def _trajectory(sample: PromptSample, ids: list[int], out: list[int], lps: list[float], vers: list[int],
                    mask: list[int], texts: list[str], turns: int, finish: str, interruptions: int,
                    reward: RewardResult) -> Trajectory:
        return Trajectory(prompt_ids=ids, output_ids=out, output_logprobs=lps, output_versions=vers,
                          loss_mask=mask, reward=reward.value, reward_reason=reward.reason, finish_reason=finish,
                          group_id=sample.uid, prompt_text=sample.prompt, completion_text="".join(texts),
                          num_turns=turns, num_interruptions=interruptions)


# --------------------------------------------------------------------------- a built-in environment

_CALC = re.compile(r"<calc>(.*?)</calc>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub,
                                                  ast.Mult: operator.mul, ast.Div: operator.truediv,
                                                  ast.Pow: operator.pow, ast.Mod: operator.mod,
                                                  ast.FloorDiv: operator.floordiv}
_UNOPS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_eval(expr: str, max_chars: int = 200) -> float:
    """Evaluate arithmetic (numbers, + - * / // % **, parentheses) without ``eval``.

    Exponents are capped so that a model cannot ask for a number with a billion digits.
    """
    if len(expr) > max_chars:
        raise ValueError(f"expression longer than {max_chars} characters")

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax: {type(node).__name__}")

    return ev(parse(expr.strip(), mode="eval"))


def _fmt(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


class CalculatorEnv:
    """A calculator tool for arithmetic prompts.

    Each model turn: a ``<calc>expr</calc>`` gets ``<result>value</result>`` back; an
    ``<answer>...</answer>`` ends the episode; anything else gets a reminder of the
    protocol. The reward is 1 when the last answer equals ``sample.answer`` numerically
    (or as text when either is not a number), else 0.
    """

    REMINDER = "Use <calc>expression</calc> to compute, or give <answer>value</answer>."

    def __init__(self, sample: PromptSample) -> None:
        if sample.answer is None:
            raise ValueError(f"CalculatorEnv: sample {sample.uid or '?'} has no answer to check against")
        self.reference = sample.answer
        self.answer: str | None = None
        self.calls = 0

    def step(self, action: str) -> EnvStep:
        answers = _ANSWER.findall(action)
        if answers:
            self.answer = answers[-1].strip()
            return EnvStep("", done=True)
        calcs = _CALC.findall(action)
        if not calcs:
            return EnvStep(self.REMINDER, done=False)
        self.calls += 1
        try:
            return EnvStep(f"<result>{_fmt(safe_eval(calcs[-1]))}</result>", done=False)
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError) as exc:
            return EnvStep(f"<error>{type(exc).__name__}: {exc}</error>", done=False)

    def reward(self) -> RewardResult:
        if self.answer is None:
            return RewardResult(0.0, "no_answer")
        return RewardResult(1.0 if _same(self.answer, self.reference) else 0.0, OK)


def _same(answer: str, reference: str) -> bool:
    try:
        a, b = float(answer.replace(",", "")), float(reference.replace(",", ""))
    except ValueError:
        return answer.strip() == reference.strip()
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


# --------------------------------------------------------------------------- from the config


def workflow_from_config(cfg: Config, tokenizer: Tokenizer, *, reward_fn: RewardFn | None = None,
                         env_factory: Callable[[PromptSample], Environment] = CalculatorEnv) -> Workflow:
    """The workflow ``cfg.rollout.workflow`` names (a :class:`realscale.config.Config`).

    Single-turn rewards default to :func:`~realscale.rollout.rewards.routed_reward` over
    ``cfg.reward``; multi-turn rewards come from ``env_factory``'s environments.
    """
    params = sampling_params_from_config(cfg.generate)
    r = cfg.rollout
    if r.workflow == "multi_turn":
        return MultiTurnWorkflow(tokenizer, r.n_samples, params, env_factory, r.max_turns,
                                 max_total_tokens=cfg.generate.context_length, env_timeout=r.reward_timeout)
    return SingleTurnWorkflow(tokenizer, r.n_samples, params, reward_fn or routed_reward(cfg.reward),
                              reward_timeout=r.reward_timeout)

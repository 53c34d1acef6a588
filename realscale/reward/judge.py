"""The code judge as a service: the sandbox runs where it can, the run scores over HTTP.

This module is the run's side (stdlib only: the reward workers may run on a bare Python);
:mod:`realscale.reward.judge_service` is the judge's.

A code recipe's reward workers run as the job's user on rank 0's node. Where that node
gives neither root nor unprivileged user namespaces, :mod:`realscale.reward.sandbox`
refuses every run, and a run scoring everything 0 would train for days on zero
advantages. So the sandbox can run elsewhere: ``realscale judge`` starts
:class:`JudgeService` on a host where it works (a root container, a node that allows user
namespaces), and a run with ``reward.code_judge_url`` scores through :class:`JudgeClient`,
which has :class:`~realscale.reward.CodeReward`'s surface (``score``, ``score_batch``,
``stats``, ``close``). The run's preflight asks the judge's ``/health`` first and refuses
to start when it cannot be reached or its sandbox is weaker than the run allows.

The protocol (JSON over HTTP):

- ``GET /health``: 200 ``{"ok": true, "mode", "full", "missing", "allow_weaker"}`` when
  the judge can score, else 503 with ``"ok": false`` and ``"reason"`` (its sandbox refuses);
- ``POST /score`` ``{"completion": str, "tests": ...}`` (any form of
  :mod:`realscale.reward.code_tests`): ``{"value", "reason", "detail"}``, the
  :class:`~realscale.reward.result.RewardResult` the judge's ``CodeReward`` gave; a
  malformed body is 400 with the reason;
- ``GET /stats``: the judge's runs by reason (``CodeReward.stats``);
- ``POST /run_code``: SandboxFusion's run-code call (bytedance/SandboxFusion
  ``sandbox/server/sandbox_api.py``: ``RunCodeRequest`` / ``RunCodeResponse``), for clients
  written against it (verl's ``sandbox_fusion`` reward). Python only, no extra files.

How it departs from SandboxFusion: the judge scores whole tests (``/score``), so the
candidate never sees the tests and never runs in the process that judges it (calls and
trusted check code run outside the sandbox, as in the in-process reward); SandboxFusion runs
one program with stdin and leaves comparing to the client. Unlike SandboxFusion's
deployment the run does not start the judge: a process the job starts has the job's own
privileges, so it would fail exactly where the in-process sandbox fails.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from realscale.reward.code_reward import ScoringPool
from realscale.reward.result import SANDBOX, TIMEOUT, RewardResult

log = logging.getLogger(__name__)

UNREACHABLE = "judge_unreachable"


class JudgeError(RuntimeError):
    """The judge cannot be used: unreachable, not a judge, or its sandbox is too weak."""


# --------------------------------------------------------------------------- the client


class JudgeClient(ScoringPool):
    """:class:`CodeReward`'s surface over a judge service's ``/score``.

    ``concurrency`` requests at a time (each thread only waits on its request). A request
    the judge cannot be reached for is retried for ``retry_s`` (a judge restarting), then
    scores 0 with reason ``sandbox`` and is counted as ``judge_unreachable`` (a warning
    each time, so a lost judge is loud in the log and the step metrics)."""

    EXTRA = (UNREACHABLE,)

    def __init__(self, url: str, concurrency: int = 4, timeout: float = 10.0, retry_s: float = 30.0,
                 slack_s: float = 30.0) -> None:
        self.url = check_url(url)
        self.timeout = float(timeout)
        self.retry_s = float(retry_s)
        self.slack_s = float(slack_s)  # beyond the runs' own timeouts: the judge's queue, HTTP
        super().__init__(concurrency, "code-judge")

    @classmethod
    def from_config(cls, cfg: "object") -> "JudgeClient":
        """Build from a :class:`realscale.config.RewardConfig` with ``code_judge_url`` set."""
        return cls(cfg.code_judge_url, concurrency=cfg.code_concurrency, timeout=cfg.timeout)  # type: ignore[attr-defined]

    def _judge(self, completion: str, tests: object) -> RewardResult:
        body = json.dumps({"completion": completion, "tests": tests}).encode()
        wait_s, deadline = self._wait_s(tests), time.monotonic() + self.retry_s
        while True:
            try:
                reply = _post(f"{self.url}/score", body, wait_s)
                return RewardResult(float(reply["value"]), str(reply["reason"]), str(reply.get("detail", "")))
            except urllib.error.HTTPError as exc:  # the judge answered: no retry will change it
                return RewardResult(0.0, SANDBOX, f"judge {self.url}: HTTP {exc.code}: {_error_text(exc)}"[:300])
            except TimeoutError:  # reached, but no verdict in time: sending it again would run it again
                return RewardResult(0.0, TIMEOUT, f"judge {self.url}: no verdict in {wait_s:.0f} s")
            except (OSError, ValueError, KeyError) as exc:  # unreachable, reset, or not a judge's reply
                if time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                self._count(UNREACHABLE)
                log.warning("code judge %s unreachable for %.0f s (%s); scoring 0", self.url, self.retry_s, exc)
                return RewardResult(0.0, SANDBOX, f"judge {self.url} unreachable: {exc}"[:300])

    def _wait_s(self, tests: object) -> float:
        # the judge runs up to one process per stdio case (a list, or APPS' "inputs"), each
        # up to its own timeout; a JSON string of cases is counted as one
        cases = tests if isinstance(tests, list) else tests.get("inputs") if isinstance(tests, dict) else None
        return self.timeout * max(1, len(cases) if isinstance(cases, list) else 1) + self.slack_s


def check_url(url: str) -> str:
    """``url`` without a trailing slash, or :class:`JudgeError` naming what is wrong."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise JudgeError(f"reward.code_judge_url: {url!r} is not an http(s) URL (e.g. http://judge-host:8500)")
    return url.rstrip("/")


def check_judge(url: str, allow_weaker: bool, timeout: float = 10.0) -> dict[str, Any]:
    """The judge's ``/health`` when it can score for a run that allows ``allow_weaker``;
    else :class:`JudgeError` with one line saying why."""
    url = check_url(url)
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
            health = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            health = json.loads(exc.read())
        except ValueError:
            raise JudgeError(f"code judge {url}: /health answered HTTP {exc.code}, not a realscale judge") from None
    except (OSError, ValueError) as exc:
        raise JudgeError(f"code judge {url} unreachable ({exc}); start it with 'realscale judge' where the sandbox "
                         "works") from None
    if not isinstance(health, dict) or "ok" not in health or "full" not in health:
        raise JudgeError(f"code judge {url}: /health is not a realscale judge's ({str(health)[:100]})")
    if not health["ok"]:
        raise JudgeError(f"code judge {url} cannot score: {health.get('reason', '?')}")
    if not health["full"] and not allow_weaker:
        missing = "; ".join(f"{k}: {v}" for k, v in (health.get("missing") or {}).items())
        raise JudgeError(f"code judge {url} runs a weaker sandbox (missing {missing}) and this run does not allow "
                         "one (reward.code_sandbox_allow_weaker=true would)")
    return health


def _post(url: str, body: bytes, timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        reply = json.loads(resp.read())
    if not isinstance(reply, dict):
        raise ValueError(f"not a judge's reply: {str(reply)[:100]}")
    return reply


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", ""))[:200]
    except (ValueError, AttributeError, OSError):
        return exc.reason if isinstance(exc.reason, str) else ""

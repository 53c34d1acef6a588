"""The judge's side of :mod:`realscale.reward.judge` (its protocol is documented there):
an aiohttp app that scores with one :class:`~realscale.reward.CodeReward`, its sandbox and
its pool, and answers SandboxFusion's ``/run_code``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from realscale.reward.code_reward import CodeReward
from realscale.reward.sandbox import RunResult, SandboxLimits, SandboxRefused

MAX_BODY = 64 << 20  # a request's bytes: a completion (<= 100k chars) and its tests, with room


class JudgeService:
    """An aiohttp app scoring with one :class:`CodeReward` (its sandbox, its pool)."""

    def __init__(self, reward: CodeReward) -> None:
        self.reward = reward

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/health", self.health)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/score", self.score)
        app.router.add_post("/run_code", self.run_code)
        return app

    def status(self) -> tuple[bool, dict[str, Any]]:
        """(can score, what ``/health`` says)."""
        iso = self.reward.isolation
        body: dict[str, Any] = {"mode": iso.mode, "full": iso.full, "missing": dict(iso.missing),
                                "allow_weaker": self.reward.allow_weaker}
        try:
            self.reward.sandbox.layers_for(self.reward.allow_weaker)
        except SandboxRefused as exc:
            return False, {"ok": False, "reason": str(exc), **body}
        return True, {"ok": True, **body}

    async def health(self, request: web.Request) -> web.Response:
        ok, body = self.status()
        return web.json_response(body, status=200 if ok else 503)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.reward.stats())

    async def score(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        completion, tests = body.get("completion"), body.get("tests")
        if not isinstance(completion, str):
            raise _bad("'completion' must be a string")
        if not isinstance(tests, (str, list, dict)):
            raise _bad("'tests' must be a string, list or object (a form of realscale.reward.code_tests)")
        result = await self.reward.score(completion, tests)
        return web.json_response({"value": result.value, "reason": result.reason, "detail": result.detail})

    async def run_code(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        code, stdin, limits = _run_code_args(body, self.reward.limits)
        try:
            layers = self.reward.sandbox.layers_for(self.reward.allow_weaker)
        except SandboxRefused as exc:
            return web.json_response({"status": "SandboxError", "message": str(exc), "compile_result": None,
                                      "run_result": None, "files": {}})
        run = await asyncio.get_running_loop().run_in_executor(
            None, self.reward.sandbox.run_stdio, code, [stdin], limits, layers, lambda i, r: False)
        return web.json_response(_run_code_response(run[0]))


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json(loads=json.loads)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"the body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    return body


def _bad(reason: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": reason}), content_type="application/json")


def _run_code_args(body: dict[str, Any], base: SandboxLimits) -> tuple[str, str, SandboxLimits]:
    """A SandboxFusion ``RunCodeRequest`` as (code, stdin, limits), or 400 naming the field."""
    code, language = body.get("code"), body.get("language")
    if not isinstance(code, str):
        raise _bad("'code' must be a string")
    if language != "python":
        raise _bad(f"language {language!r}: this judge runs python only")
    if body.get("files") or body.get("fetch_files"):
        raise _bad("'files' / 'fetch_files': this judge runs a single program (no extra files)")
    stdin = body.get("stdin") or ""
    if not isinstance(stdin, str):
        raise _bad("'stdin' must be a string")
    timeout = body.get("run_timeout", 10)
    memory = body.get("memory_limit_MB", -1)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise _bad(f"'run_timeout' must be a positive number, got {timeout!r}")
    if not isinstance(memory, int) or isinstance(memory, bool) or (memory <= 0 and memory != -1):
        raise _bad(f"'memory_limit_MB' must be a positive integer or -1, got {memory!r}")
    # the judge's own limits are the ceiling: a client may ask for less, never more
    limits = SandboxLimits(**{**base.as_spec(), "timeout": min(float(timeout), base.timeout),
                              "memory_mb": base.memory_mb if memory == -1 else min(memory, base.memory_mb)})
    return code, stdin, limits


def _run_code_response(run: RunResult) -> dict[str, Any]:
    """SandboxFusion's ``RunCodeResponse`` for one run (its ``parse_run_status`` rules)."""
    if run.setup_failed:
        status, message, state = "SandboxError", str(run.setup_error), "Error"
    elif run.timed_out:
        status, message, state = "Failed", "", "TimeLimitExceeded"
    else:
        status, message, state = ("Success" if run.returncode == 0 else "Failed"), "", "Finished"
    return {"status": status, "message": message, "compile_result": None, "files": {},
            "run_result": {"status": state, "execution_time": run.wall_s, "return_code": run.returncode,
                           "stdout": run.stdout, "stderr": run.stderr}}


def serve_judge(reward: CodeReward, host: str, port: int) -> int:
    """Run the judge until interrupted; returns the exit code."""
    web.run_app(JudgeService(reward).app(), host=host, port=port, print=None, handle_signals=True,
                access_log=None, handler_cancellation=True)
    return 0

"""The code judge service (GPU-path defect 4's way out where the run's host cannot sandbox):
a real ``realscale judge`` process on loopback scores exactly as the in-process reward does,
speaks SandboxFusion's ``/run_code`` (bytedance/SandboxFusion ``sandbox/server/sandbox_api.py``:
``RunCodeRequest``, ``RunCodeResponse``, ``parse_run_status``), and a code recipe pointing at
a judge that is not there, or is not a judge, is refused before any process starts. The
cluster case itself (the trainer's host without user namespaces) is in test_sandbox_userns.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from realscale.commands.train import _check_code_sandbox
from realscale.config import load_config
from realscale.data.dataset import PromptSample
from realscale.errors import UserError
from realscale.parallel.net import free_port
from realscale.reward.code_reward import CodeReward
from realscale.reward.judge import JudgeClient, JudgeError, check_judge
from realscale.rollout.rewards import close_reward_pools, reward_fn_for, reward_pool_stats

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the judge's full sandbox needs root here")

ADD_CHECK = "assert add(1, 2) == 3\nassert add(-1, 5) == 4\n"
STDIO = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12\n"}]
CALLS = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}
PAIRS = [
    ("def add(a, b):\n    return a + b\n", ADD_CHECK),
    ("def add(a, b):\n    return a - b\n", ADD_CHECK),
    ("a, b = map(int, input().split())\nprint(a + b)\n", STDIO),
    ("print(3)\n", STDIO),
    ("def add(a, b):\n    return a + b\n", CALLS),
    ("def add(a, b):\n    return 3\n", CALLS),
    ("", ADD_CHECK),
    ("def add(a, b):\n    return a + b\n", {"not": "a test form"}),
]
LIMITS = ["reward.timeout=20", "reward.code_memory_mb=512", "reward.code_concurrency=2"]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post(url: str, body: object) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _start_judge(port: int, *overrides: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "realscale", "judge", "--port", str(port), *LIMITS,
                             *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def judge() -> str:
    port = free_port()
    proc = _start_judge(port)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                if _get(f"{url}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the judge did not answer /health in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_judge_scores_as_the_in_process_reward(judge: str) -> None:
    """Every test form (check code, stdin/stdout, calls), right and wrong answers, no code, a
    malformed test: the judge's (value, reason, detail) equal the in-process reward's."""
    remote = JudgeClient(judge, concurrency=2, timeout=20.0)
    local = CodeReward(concurrency=2, timeout=20.0, memory_mb=512)
    try:
        got = [(r.value, r.reason, r.detail) for r in remote.score_batch(PAIRS)]
        want = [(r.value, r.reason, r.detail) for r in local.score_batch(PAIRS)]
    finally:
        remote.close()
        local.close()
    assert got == want
    assert [v for v, _, _ in got] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert [r for _, r, _ in got][-2:] == ["no_answer", "error"]
    assert remote.stats()["passed"] == 3 and remote.stats()["judge_unreachable"] == 0


def test_health_says_what_the_judge_isolates(judge: str) -> None:
    status, health = _get(f"{judge}/health")
    assert status == 200 and health["ok"] and health["full"] and health["mode"] == "root"
    assert health["missing"] == {} and health["allow_weaker"] is False
    assert check_judge(judge, allow_weaker=False)["ok"]


def test_code_recipe_through_the_judge_passes_preflight_and_scores(judge: str) -> None:
    """reward.code_judge_url: preflight asks the judge (not this host's sandbox), and the run's
    reward functions (reward_fn_for, as the rollout workflow calls them) score through it."""
    cfg = load_config(None, ["reward.kind=code", f"reward.code_judge_url={judge}", *LIMITS])
    _check_code_sandbox(cfg)
    sample = PromptSample(prompt="add", answer=None, tests=ADD_CHECK, uid="s0")
    _, before = _get(f"{judge}/stats")
    try:
        fn = reward_fn_for(cfg.reward, sample)
        good, bad = asyncio.run(_both(fn, sample))
        assert (good.value, bad.value) == (1.0, 0.0)
        stats = reward_pool_stats()
        assert stats["reward_pool/passed"] == 1 and stats["reward_pool/judge_unreachable"] == 0
    finally:
        close_reward_pools()
    _, after = _get(f"{judge}/stats")
    assert after["ok"] - before["ok"] == 2 and after["passed"] - before["passed"] == 1  # the judge ran both


async def _both(fn, sample):
    return await asyncio.gather(fn("add", "def add(a, b):\n    return a + b\n", sample),
                                fn("add", "def add(a, b):\n    return 0\n", sample))


def test_run_code_speaks_sandboxfusion(judge: str) -> None:
    """SandboxFusion's RunCodeRequest in, its RunCodeResponse out (status Success / Failed,
    run_result Finished / TimeLimitExceeded with return_code, stdout, stderr), in the sandbox."""
    run = f"{judge}/run_code"
    status, ok = _post(run, {"code": "import sys\nprint(sys.stdin.read().upper())", "stdin": "hi", "language": "python"})
    assert status == 200 and ok["status"] == "Success" and ok["compile_result"] is None and ok["files"] == {}
    assert ok["run_result"]["status"] == "Finished" and ok["run_result"]["return_code"] == 0
    assert ok["run_result"]["stdout"] == "HI\n"
    _, failed = _post(run, {"code": "import sys\nprint('x', file=sys.stderr)\nsys.exit(3)", "language": "python"})
    assert failed["status"] == "Failed" and failed["run_result"]["return_code"] == 3
    assert failed["run_result"]["stderr"] == "x\n"
    start = time.monotonic()
    _, slow = _post(run, {"code": "while True:\n    pass", "language": "python", "run_timeout": 1})
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"
    assert time.monotonic() - start < 15  # the client's run_timeout, not the judge's 20 s
    port = judge.rsplit(":", 1)[1]
    probe = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('reached')\n" \
            "except OSError as e:\n    print('isolated')"
    _, net = _post(run, {"code": probe, "language": "python"})
    assert net["run_result"]["stdout"] == "isolated\n"  # the program cannot reach the judge itself


def test_bad_requests_are_named(judge: str) -> None:
    status, body = _post(f"{judge}/run_code", {"code": "int main(){}", "language": "cpp"})
    assert status == 400 and "python only" in body["error"]
    status, body = _post(f"{judge}/run_code", {"code": "print(1)", "language": "python", "files": {"a.txt": "eA=="}})
    assert status == 400 and "files" in body["error"]
    status, body = _post(f"{judge}/run_code", {"code": "print(1)", "language": "python", "run_timeout": -1})
    assert status == 400 and "run_timeout" in body["error"]
    status, body = _post(f"{judge}/score", b"{not json")
    assert status == 400 and "not JSON" in body["error"]
    status, body = _post(f"{judge}/score", {"tests": ADD_CHECK})
    assert status == 400 and "'completion'" in body["error"]


def test_a_missing_judge_is_refused_before_the_run_and_scores_0_if_lost() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    cfg = load_config(None, ["reward.kind=code", f"reward.code_judge_url={url}"])
    with pytest.raises(UserError) as err:
        _check_code_sandbox(cfg)
    msg = str(err.value)
    assert "\n" not in msg and f"code judge {url} unreachable" in msg and "realscale judge" in msg
    client = JudgeClient(url, concurrency=1, timeout=1.0, retry_s=0.0)
    try:
        (r,) = client.score_batch([("def add(a, b):\n    return a + b\n", ADD_CHECK)])
        assert (r.value, r.reason) == (0.0, "sandbox") and "unreachable" in r.detail
        assert client.stats()["judge_unreachable"] == 1
    finally:
        client.close()


def test_a_judge_that_never_answers_scores_timeout_once() -> None:
    """Reached but silent past the runs' time: 0 with reason ``timeout``, and the request is
    not sent again (a resend would run the program again)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])  # read nothing, answer nothing
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    client = JudgeClient(f"http://127.0.0.1:{listener.getsockname()[1]}", concurrency=1, timeout=0.5, slack_s=0.5)
    try:
        (r,) = client.score_batch([("print(1)\n", STDIO)])  # two cases: 2 x 0.5 + 0.5 s
    finally:
        client.close()
        listener.close()
    assert (r.value, r.reason) == (0.0, "timeout") and "no verdict in 2 s" in r.detail, r
    assert len(accepted) == 1 and client.stats()["judge_unreachable"] == 0


def test_a_server_that_is_not_a_judge_is_refused() -> None:
    class NotAJudge(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotAJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(JudgeError, match="is not a realscale judge"):
            check_judge(f"http://127.0.0.1:{server.server_address[1]}", allow_weaker=False)
    finally:
        server.shutdown()
    with pytest.raises(JudgeError, match="not an http"):
        check_judge("judge-host:8500", allow_weaker=False)


def test_bad_judge_urls_and_settings_are_config_errors() -> None:
    from realscale.config import ConfigError

    with pytest.raises(ConfigError, match="reward.code_judge_url"):
        load_config(None, ["reward.code_judge_url=judge-host:8500"])
    out = subprocess.run([sys.executable, "-m", "realscale", "judge", "reward.code_judge_url=http://x:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "a judge scores itself" in out.stderr


def test_a_judge_that_cannot_sandbox_refuses_to_start() -> None:
    """As root of a user namespace (unshare --map-root-user) the judge cannot drop root for
    the program: it refuses to start, in one line, instead of serving zeros."""
    if subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a user namespace here")
    proc = _start_judge(free_port(), prefix=("unshare", "--user", "--map-root-user"))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("realscale: error:")]
    assert "the sandbox cannot run here: sandbox refused: cannot drop root" in line

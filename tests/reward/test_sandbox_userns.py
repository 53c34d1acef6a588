"""GPU-path defect 4: code rewards without root. Under Slurm the reward workers run as the
job's user; the sandbox then builds its layers from a user namespace per candidate process.

Each test runs the sandbox as a real unprivileged uid (``setpriv`` from root, a uid with no
passwd entry and no other process), with the system Python and a copy of the package it
can read. Where the kernel forbids unprivileged user namespaces is simulated by the kernel
itself: the driver enters a user namespace whose ``user.max_user_namespaces`` is 0 and
execs Python there, so the sandbox's own ``unshare(CLONE_NEWUSER)`` fails as it would on
such a cluster (nothing in the code is told to fail).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from realscale.reward.sandbox import USERNS_LAYERS, nproc_per_userns

UID = 60999  # below the root sandbox's uids (61000+); no passwd entry, no process of its own
PY = "/usr/bin/python3"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(PY)
    or not os.path.exists("/proc/self/ns/user"),
    reason="needs root to become an unprivileged uid (setpriv), a system Python that uid can read, user namespaces")

# The driver: run as UID. argv[1] is "allowed" (user namespaces as the host gives them) or
# "disabled" (first enter a user namespace where no further one may be made, then re-exec).
_DRIVER = r'''
import json, os, socket, sys, time
mode = sys.argv[1]
if mode == "disabled" and len(sys.argv) == 2:
    from realscale.reward._sandbox_exec import enter_userns
    enter_userns(os.getuid(), os.getgid(), nested=0)
    os.execv(sys.executable, [sys.executable, "-c", LAUNCH, mode, "inside"])
import logging
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from types import SimpleNamespace
from realscale.commands.train import _check_code_sandbox
from realscale.errors import UserError
from realscale.reward.code_reward import CodeReward
from realscale.reward.sandbox import SandboxLimits

out = {"uid": os.getuid()}
def preflight(allow, judge=""):
    cfg = SimpleNamespace(reward=SimpleNamespace(kind="code", code_python="", code_uid_base=61000,
                                                 code_sandbox_allow_weaker=allow, code_judge_url=judge))
    try:
        _check_code_sandbox(cfg)
        return None
    except UserError as exc:
        return str(exc)
out["preflight"], out["preflight_weak"] = preflight(False), preflight(True)
ADD = "assert add(1, 2) == 3\nassert add(-1, 5) == 4\n"
GOOD = "def add(a, b):\n    return a + b\n"
def scored(reward, pairs):
    t = time.monotonic()
    res = reward.score_batch(pairs)
    return [(r.value, r.reason, r.detail[:300]) for r in res], time.monotonic() - t

if mode == "disabled" and os.environ.get("JUDGE_URL"):  # this host cannot sandbox; a judge elsewhere can
    from realscale.reward.judge import JudgeClient
    url = os.environ["JUDGE_URL"]
    out["preflight_judge"] = preflight(False, url)
    client = JudgeClient(url, concurrency=2, timeout=5.0)
    out["judged"], _ = scored(client, [(GOOD, ADD), ("def add(a, b):\n    return 0\n", ADD)])
    out["judged_stats"] = client.stats()
    client.close()
    print(json.dumps(out))
    sys.exit(0)
if mode == "disabled":
    with CodeReward(concurrency=1, timeout=5.0) as strict:
        out["missing"] = strict.isolation.missing
        out["strict"], _ = scored(strict, [(GOOD, ADD)])
    with CodeReward(concurrency=1, timeout=5.0, allow_weaker=True) as weak:
        out["weak"], _ = scored(weak, [(GOOD, ADD), (GOOD, ADD), ("def add(a, b):\n    return 0\n", ADD)])
        out["stats"] = weak.stats()
    print(json.dumps(out))
    sys.exit(0)

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(8)
port = listener.getsockname()[1]
outside = os.path.join(os.environ["TMPDIR"], "written-by-the-program")
with CodeReward(concurrency=2, timeout=2.0, memory_mb=256, nproc=16) as reward:
    iso = reward.isolation
    out["mode"], out["layers"], out["missing"], out["notes"] = iso.mode, iso.layers, iso.missing, iso.notes
    sb, layers = reward.sandbox, reward.sandbox.layers_for(False)
    facts = sb.run_program(r"""
import ctypes, json, os, socket
f = {"uid": os.getuid(), "euid": os.geteuid(), "caps": [l.split()[1] for l in open("/proc/self/status") if l.startswith("Cap")]}
f["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=2).close(); f["net"] = "connected"
except OSError as e:
    f["net"] = str(e)
f["wrote"] = []
for t in (OUTSIDE, "/usr/x", "/x", "/etc/x"):
    try:
        open(t, "w").write("x"); f["wrote"].append(t)
    except OSError as e:
        pass
open("/sandbox/mine", "w").write("x"); open("/tmp/mine", "w").write("x")
f["own_dirs"] = os.path.exists("/sandbox/mine") and os.path.exists("/tmp/mine")
f["see_outside"] = os.path.exists(OUTSIDE.rsplit("/", 1)[0])
libc = ctypes.CDLL(None, use_errno=True)
f["nested_userns"] = libc.unshare(0x10000000) == 0
f["forked"] = 0
try:
    for _ in range(64):  # children that stay: the run's process cap (16) stops this
        if os.fork() == 0:
            import time; time.sleep(30); os._exit(0)
        f["forked"] += 1
except OSError:
    pass
print(json.dumps(f))
""".replace("PORT", str(port)).replace("OUTSIDE", repr(outside)), SandboxLimits(timeout=5.0), layers)
    out["facts"] = json.loads(facts.stdout) if facts.returncode == 0 else {"error": facts.stderr[-2000:] + str(facts.setup_error)}
    listener.setblocking(False)
    try:
        listener.accept(); out["accepted"] = True
    except BlockingIOError:
        out["accepted"] = False
    out["outside_exists"] = os.path.exists(outside)
    stdio = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12\n"}]
    out["correct"], _ = scored(reward, [(GOOD, ADD), ("a, b = map(int, input().split())\nprint(a + b)\n", stdio),
                                        ("def add(a, b):\n    return a - b\n", ADD)])
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    out["bomb"], out["bomb_s"] = scored(reward, [(bomb, ADD)])
    time.sleep(0.2)
    left = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and b"program.py" in open(f"/proc/{p}/cmdline", "rb").read():
                left.append(int(p))
        except OSError:
            pass
    out["bomb_left"] = left
    out["after_bomb"], _ = scored(reward, [(GOOD, ADD)])
    hog = "def add(a, b):\n    blob = bytearray(1 << 30)\n    return a + b\n"
    out["hog"], out["hog_s"] = scored(reward, [(hog, ADD)])
    split = ("import os, time\ndef add(a, b):\n    kids = []\n    for _ in range(3):\n        pid = os.fork()\n"
             "        if pid == 0:\n            blob = bytearray(b'\\x01') * (150 << 20)\n            time.sleep(1.5)\n"
             "            os._exit(0)\n        kids.append(pid)\n"
             "    return a + b if all(os.waitpid(k, 0)[1] == 0 for k in kids) else 0\n")
    out["split"], out["split_s"] = scored(reward, [(split, ADD)])
    loop = "def add(a, b):\n    while True:\n        pass\n"
    out["loop"], out["loop_s"] = scored(reward, [(loop, ADD)])
    out["preflight_allowed"] = out.pop("preflight")
print(json.dumps(out))
'''


_LAUNCH = "import os; LAUNCH = os.environ['LAUNCH']; exec(os.environ['DRIVER'])"


def _run_as_user(tmp_path, mode: str, judge_url: str = "") -> dict:
    pkg = tmp_path / "pkg"
    if not pkg.exists():  # the checkout may sit where the uid cannot read: give it a copy
        shutil.copytree(os.path.join(REPO, "realscale"), pkg / "realscale", ignore=shutil.ignore_patterns("__pycache__"))
        for path in (tmp_path, *tmp_path.parents[:2]):  # pytest's own base directories are 0700
            os.chmod(path, os.stat(path).st_mode | 0o711)
        os.chmod(tmp_path, 0o777)
        for root, dirs, files in os.walk(pkg):
            for name in dirs + files:
                os.chmod(os.path.join(root, name), 0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pkg), "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
           "DRIVER": _DRIVER, "LAUNCH": _LAUNCH, "JUDGE_URL": judge_url}
    out = subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", PY, "-c", _LAUNCH, mode],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["_stderr"] = out.stderr
    return got


@pytest.fixture(scope="module")
def allowed(tmp_path_factory) -> dict:
    got = _run_as_user(tmp_path_factory.mktemp("userns"), "allowed")
    if got["missing"].get("userns"):
        pytest.skip(f"this host forbids unprivileged user namespaces: {got['missing']['userns']}")
    return got


def test_unprivileged_sandbox_has_every_layer(allowed: dict) -> None:
    assert allowed["uid"] == UID and allowed["mode"] == "userns"
    assert allowed["missing"] == {} and all(allowed["layers"][k] for k in USERNS_LAYERS)
    assert allowed["layers"]["cgroup"] or "the run's memory is watched" in allowed["notes"]["cgroup"]
    assert allowed["preflight_allowed"] is None  # the code recipe starts


def test_the_program_is_unprivileged_and_alone(allowed: dict) -> None:
    f = allowed["facts"]
    assert "error" not in f, f
    assert f["uid"] == f["euid"] == UID  # the trainer's uid, never 0
    assert all(int(v, 16) == 0 for v in f["caps"][:3] + f["caps"][4:]), f["caps"]  # no capability (bounding aside)
    assert f["pids"] in ([1], []), f["pids"]  # its own PID namespace (or no /proc)
    assert not f["nested_userns"]  # cannot make a user namespace of its own to regain capabilities
    if nproc_per_userns():
        assert 10 <= f["forked"] < 16, f["forked"]  # the run's process cap, counted in its own user namespace


def test_network_is_unreachable(allowed: dict) -> None:
    assert "unreachable" in allowed["facts"]["net"] or "refused" in allowed["facts"]["net"], allowed["facts"]["net"]
    assert allowed["accepted"] is False  # the host's listener on 127.0.0.1 never saw it


def test_writing_outside_its_dirs_fails(allowed: dict) -> None:
    f = allowed["facts"]
    assert f["wrote"] == [] and not f["see_outside"] and not allowed["outside_exists"]
    assert f["own_dirs"]  # its work dir and /tmp are writable


def test_correct_answers_score_1(allowed: dict) -> None:
    assert [(v, r) for v, r, _ in allowed["correct"]] == [(1.0, "ok"), (1.0, "ok"), (0.0, "ok")]


@pytest.mark.skipif(not nproc_per_userns(), reason="the process cap needs Linux >= 5.14")
def test_fork_bomb_is_capped_killed_and_gone(allowed: dict) -> None:
    (value, _, _), = allowed["bomb"]
    assert value == 0.0 and allowed["bomb_s"] < 2.0 + 5.0, allowed["bomb_s"]
    assert allowed["bomb_left"] == []  # every forked process died with the run
    assert [v for v, _, _ in allowed["after_bomb"]] == [1.0]


def test_memory_hog_and_infinite_loop_are_contained(allowed: dict) -> None:
    (value, reason, detail), = allowed["hog"]
    assert value == 0.0 and "MemoryError" in detail and allowed["hog_s"] < 5.0, (reason, detail)
    (value, reason, detail), = allowed["split"]  # 3 x 150 MB: each fits 256 MB, the run does not
    assert value == 0.0 and allowed["split_s"] < 1.5, (reason, detail, allowed["split_s"])
    (value, reason, _), = allowed["loop"]
    assert (value, reason) == (0.0, "timeout") and allowed["loop_s"] < 2.0 + 4.0, allowed["loop_s"]


def test_without_user_namespaces_the_code_recipe_is_refused_with_the_fix(tmp_path) -> None:
    """The kernel refuses the sandbox's user namespace (user.max_user_namespaces is 0 where the
    trainer runs): preflight refuses in one line naming the layer, the sysctl and the way out;
    the reward scores 0 with reason ``sandbox``; allowed weaker, it runs with one warning."""
    got = _run_as_user(tmp_path, "disabled")
    msg = got["preflight"]
    assert msg and "\n" not in msg and msg.startswith("reward.kind=code: sandbox refused: missing userns: ")
    assert "No space left on device" in msg and "sysctl -w user.max_user_namespaces=" in msg
    assert "reward.code_sandbox_allow_weaker=true" in msg
    assert got["preflight_weak"] is None
    assert sorted(got["missing"]) == sorted(USERNS_LAYERS)
    [(value, reason, detail)] = got["strict"]
    assert (value, reason) == (0.0, "sandbox") and "missing userns" in detail
    assert [(v, r) for v, r, _ in got["weak"]] == [(1.0, "ok"), (1.0, "ok"), (0.0, "ok")]
    assert got["stats"]["sandbox_weakened"] == 3
    assert got["_stderr"].count("running WITHOUT a full sandbox") == 1


def test_without_user_namespaces_a_code_judge_elsewhere_scores(tmp_path) -> None:
    """The cluster case the judge service is for: the trainer's host forbids user namespaces
    (as above), a ``realscale judge`` runs where the sandbox works (here: as root), and the
    run with ``reward.code_judge_url`` passes preflight and scores 1 / 0 through it."""
    import sys
    import time
    import urllib.request

    from realscale.parallel.net import free_port

    port = free_port()
    judge = subprocess.Popen([sys.executable, "-m", "realscale", "judge", "--port", str(port), "reward.timeout=10"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).close()
                break
            except OSError:
                assert judge.poll() is None and time.monotonic() < deadline, "the judge did not start"
                time.sleep(0.2)
        got = _run_as_user(tmp_path, "disabled", judge_url=url)
    finally:
        judge.terminate()
        judge.wait(timeout=30)
    assert got["preflight_judge"] is None  # this host's own sandbox would be refused (test above)
    assert [(v, r) for v, r, _ in got["judged"]] == [(1.0, "ok"), (0.0, "ok")]
    assert got["judged_stats"]["passed"] == 1 and got["judged_stats"]["judge_unreachable"] == 0

"""A battery of hostile programs against CodeReward: each tries to score without solving,
to read what it must not, or to hurt the host or another run.

Each case is a function ``case_<name>(env) -> list[str]`` that scores its program(s)
through ``env.reward`` and returns the violations it saw (empty: contained). The battery is
run in-process by ``test_sandbox_hostile.py`` and, to cover a trainer whose Python lives
under /tmp (a venv there), by the same file run as a script with that Python:

    python tests/reward/hostile.py battery            # prints {case: [violations]} as JSON
    python tests/reward/hostile.py victim             # scores JSON pairs read from stdin

The problems the programs face are built so that a real solution is impossible: the
expected answer is a fresh random token that only the hidden test (or a file the program
must not see) holds, or the check needs the program to do what the sandbox forbids.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 5) == 4\nassert add(10, 20) == 30\n"
LIMITS = {"concurrency": 4, "timeout": 10.0, "memory_mb": 512, "nproc": 16}  # generous: the machine is shared


def make_reward(**overrides: object):
    from realscale.reward.code_reward import CodeReward

    return CodeReward(**{**LIMITS, **overrides})


@dataclass
class Env:
    """What the cases share: the reward, a fake "trainer" process that holds a dataset path
    on its command line and a secret in its environment, and names unique to this battery."""

    reward: object
    tag: str = field(default_factory=lambda: secrets.token_hex(6))
    trainer: subprocess.Popen | None = None
    data_dir: str = ""
    data_token: str = ""
    env_token: str = ""
    cleanup: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.data_token, self.env_token = _token(), _token()
        self.data_dir = tempfile.mkdtemp(prefix=f"realscale-hostile-{self.tag}-", dir="/var/lib")
        os.chmod(self.data_dir, 0o755)
        data = os.path.join(self.data_dir, "train.jsonl")
        with open(data, "w") as fh:
            fh.write(json.dumps({"prompt": "answer()", "tests": f"assert answer() == {self.data_token!r}"}) + "\n")
        os.chmod(data, 0o644)
        env = {**os.environ, "REALSCALE_HOSTILE_SECRET": self.env_token}
        self.trainer = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)", "--data", data, f"hostile-trainer-{self.tag}"],
            env=env)

    def stop(self) -> None:
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.kill()
            self.trainer.wait()
        subprocess.run(["rm", "-rf", self.data_dir, *self.cleanup], check=False)

    def score(self, completion: str, tests: object) -> tuple[float, str]:
        (r,) = self.reward.score_batch([(completion, tests)])
        return r.value, f"{r.reason}: {r.detail[:200]}"


def _token() -> str:
    return "tok-" + secrets.token_hex(8)


def _scored(value: float, detail: str, what: str) -> list[str]:
    return [f"{what} scored {value} ({detail})"] if value != 0.0 else []


def _answer_tests(token: str) -> str:
    return f"assert answer() == {token!r}\n"


# A program that searches the places it can reach for a token and answers with the first.
_SEARCH = '''
import os, re
PAT = re.compile(r"tok-[0-9a-f]{{16}}")
def _grep(path, limit=1 << 20):
    try:
        with open(path, "rb") as fh:
            m = PAT.search(fh.read(limit).decode("latin-1"))
            return m.group(0) if m else None
    except Exception:
        return None
def _candidates():
{body}
def answer():
    for path in _candidates():
        found = _grep(path)
        if found:
            return found
    return None
'''


def _search_program(body: str) -> str:
    return _SEARCH.format(body="\n".join("    " + line for line in body.strip().splitlines()))


_PROC_ALL = '''
for pid in os.listdir("/proc"):
    if pid.isdigit():
        yield from (f"/proc/{pid}/{name}" for name in ("cmdline", "environ"))
        yield f"/proc/{pid}/cwd/program.py"
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        yield from (a.decode() for a in args if a.endswith(b".jsonl"))
'''

# ------------------------------------------------------------------ verdict forging


def case_os_exit(env: Env) -> list[str]:
    """os._exit(0) after defining a wrong function: exit status 0 must not mean passed."""
    return _scored(*env.score("def add(a, b):\n    return 0\nimport os\nos._exit(0)\n", ADD_TESTS), "os._exit(0)")


def case_always_equal(env: Env) -> list[str]:
    """An object whose __eq__ always answers True (and __ne__ False)."""
    prog = ("class Yes:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
            "    __hash__ = object.__hash__\n"
            "def add(a, b):\n    return Yes()\n")
    return _scored(*env.score(prog, ADD_TESTS), "always-equal __eq__")


def case_system_exit(env: Env) -> list[str]:
    """``raise SystemExit`` inside the function (exit status 0)."""
    return _scored(*env.score("def add(a, b):\n    raise SystemExit\n", ADD_TESTS), "raise SystemExit")


def case_sys_exit_256(env: Env) -> list[str]:
    """sys.exit(256): the exit status wraps to 0."""
    return _scored(*env.score("import sys\ndef add(a, b):\n    sys.exit(256)\n", ADD_TESTS), "sys.exit(256)")


def case_atexit(env: Env) -> list[str]:
    """atexit turns the failing test's exit status into 0."""
    prog = "import atexit, os\natexit.register(os._exit, 0)\ndef add(a, b):\n    return 0\n"
    return _scored(*env.score(prog, ADD_TESTS), "atexit os._exit(0)")


def case_rebind_builtins(env: Env) -> list[str]:
    """Rebinding builtins the tests use (abs, isinstance, len)."""
    prog = ("import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\n"
            "builtins.len = lambda x: 1\ndef add(a, b):\n    return 0\n")
    tests = "assert abs(add(1, 2) - 3) < 1e-9\nassert isinstance(add(1, 2), int)\nassert len([add(0, 0)]) == 1\n"
    return _scored(*env.score(prog, tests), "rebound builtins")


def case_tamper_harness(env: Env) -> list[str]:
    """Tamper with whatever runs the calls: json, sys.stdout, print, sys.exit, signals."""
    prog = ("import json, sys, builtins, os\n"
            "json.dumps = lambda *a, **k: 'true'\njson.loads = lambda *a, **k: True\n"
            "json.JSONEncoder.encode = lambda self, o: '3'\n"
            "for fd in range(3, 20):\n    try:\n        os.write(fd, b'{\"ok\": 3}\\n' * 50)\n    except OSError:\n        pass\n"
            "def add(a, b):\n    print('PASSED'); sys.stdout.flush()\n    return 0\n")
    return _scored(*env.score(prog, ADD_TESTS), "tampered harness")


# ------------------------------------------------------------------ reading what it must not


def case_read_tests_in_workdir(env: Env) -> list[str]:
    """Read the hidden test (and its answer) from the files next to the program."""
    token = _token()
    prog = _search_program('''
for root, _, files in os.walk("."):
    yield from (os.path.join(root, f) for f in files)
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    for root, _, files in os.walk(d):
        yield from (os.path.join(root, f) for f in files)
''')
    return _scored(*env.score(prog, _answer_tests(token)), "reading the tests in the work dir")


def case_dataset_via_proc_cmdline(env: Env) -> list[str]:
    """Find the dataset through /proc/<trainer>/cmdline and read the answer from it."""
    prog = _search_program(_PROC_ALL)
    return _scored(*env.score(prog, _answer_tests(env.data_token)), "dataset via /proc/<pid>/cmdline")


def case_trainer_environment(env: Env) -> list[str]:
    """Read the trainer's environment (a secret in it is the answer)."""
    prog = _search_program(_PROC_ALL)
    return _scored(*env.score(prog, _answer_tests(env.env_token)), "trainer environment")


def case_checkout_and_site_packages(env: Env) -> list[str]:
    """Read a token from the checkout; see the HumanEval data in site-packages."""
    token = _token()
    path = os.path.join(HERE, f".hostile-{env.tag}.txt")
    with open(path, "w") as fh:
        fh.write(token)
    os.chmod(path, 0o644)
    env.cleanup.append(path)
    value, detail = env.score(_search_program(f"yield {path!r}"), _answer_tests(token))
    out = _scored(value, detail, "reading the checkout")
    import site

    dirs = sorted({sysconfig.get_paths()["purelib"], *site.getsitepackages()})
    seen = (f"import os\ndef seen():\n    dirs = {dirs!r}\n"
            f"    return any(os.path.isdir(d) and os.listdir(d) for d in dirs) or os.path.isdir({REPO!r})\n")
    out += _scored(*env.score(seen, "assert seen() == True\n"), "seeing site-packages or the checkout")
    return out


def case_see_other_processes(env: Env) -> list[str]:
    """/proc must show no process outside the run."""
    prog = ("import os\ndef others():\n    mine = {os.getpid(), os.getppid()}\n"
            "    pids = {int(p) for p in os.listdir('/proc') if p.isdigit()}\n    return len(pids - mine) > 3\n")
    return _scored(*env.score(prog, "assert others() == True\n"), "seeing other processes")


def case_runs_as_root(env: Env) -> list[str]:
    """The program must never run as root (uid 0) nor with capabilities."""
    prog = ("import os\ndef root():\n    caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')]\n"
            "    return os.geteuid() == 0 or os.getuid() == 0 or caps[0].split()[1].strip('0') != ''\n")
    return _scored(*env.score(prog, "assert root() == True\n"), "running as root")


# ------------------------------------------------------------------ hurting the host


def _marker_alive(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if marker.encode() in fh.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def case_kill_trainer(env: Env) -> list[str]:
    """Kill the trainer (and everything else it can: kill(-1, SIGKILL))."""
    prog = (f"import os, signal\nMARK = b'hostile-trainer-{env.tag}'\n"
            "def add(a, b):\n    for pid in os.listdir('/proc'):\n        if pid.isdigit():\n"
            "            try:\n                if MARK in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
            "                    os.kill(int(pid), signal.SIGKILL)\n            except OSError:\n                pass\n"
            "    return a + b\n")
    value, detail = env.score(prog, ADD_TESTS)
    out = [] if value == 1.0 else [f"a correct program that tried to kill the trainer scored {value} ({detail})"]
    time.sleep(0.2)
    if env.trainer.poll() is not None:
        out.append("the trainer was killed")
    return out


def case_kill_everything(env: Env) -> list[str]:
    """kill(-1, SIGKILL): every process the program may signal."""
    prog = "import os, signal\ndef add(a, b):\n    os.kill(-1, signal.SIGKILL)\n    return a + b\n"
    env.score(prog, ADD_TESTS)
    time.sleep(0.2)
    return ["the trainer was killed by kill(-1)"] if env.trainer.poll() is not None else []


def case_write_checkout(env: Env) -> list[str]:
    """Write into the checkout, site-packages and /var/lib (root-owned places)."""
    site = sysconfig.get_paths()["purelib"]
    targets = [os.path.join(HERE, f"hostile-{env.tag}.py"), os.path.join(site, f"hostile_{env.tag}.pth"),
               os.path.join(env.data_dir, "written.txt")]
    env.cleanup.extend(targets)
    prog = (f"def add(a, b):\n    for t in {targets!r}:\n        try:\n"
            "            open(t, 'w').write('import os')\n        except OSError:\n            pass\n    return a + b\n")
    env.score(prog, ADD_TESTS)
    return [f"wrote {t}" for t in targets if os.path.exists(t)]


def case_daemon(env: Env) -> list[str]:
    """Leave a daemon (double fork + setsid) that would outlive the run."""
    marker = f"hostile-daemon-{env.tag}"
    prog = ("import os, sys\ndef add(a, b):\n    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
            f"            os.execv(sys.executable, [sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.1)', {marker!r}])\n"
            "        os._exit(0)\n    return a + b\n")
    env.score(prog, ADD_TESTS)
    alive: list[int] = []
    for _ in range(20):  # a killed process may take a moment to vanish from /proc
        alive = _marker_alive(marker)
        if not alive:
            return []
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return [f"daemon survived the run (pids {alive})"]


def case_files_outlive_run(env: Env) -> list[str]:
    """Files and unix sockets in shared writable places (/run/lock, /var/tmp, /dev/shm, /tmp)."""
    name = f"realscale-hostile-{env.tag}"
    places = ["/run/lock", "/var/lock", "/var/tmp", "/dev/shm", "/tmp"]
    paths = [f"{p}/{name}" for p in places] + [f"{p}/{name}.sock" for p in places]
    env.cleanup.extend(paths)
    prog = ("import socket\n"
            f"def add(a, b):\n    for p in {places!r}:\n        try:\n            open(p + '/{name}', 'w').write('x')\n"
            "        except OSError:\n            pass\n        try:\n"
            f"            socket.socket(socket.AF_UNIX).bind(p + '/{name}.sock')\n        except OSError:\n            pass\n"
            "    return a + b\n")
    env.score(prog, ADD_TESTS)
    out = [f"{p} outlived the run" for p in paths if os.path.exists(p)]
    # and a later run must not find them either
    probe = f"import os\ndef left():\n    return any(os.path.exists(p) for p in {paths!r})\n"
    out += _scored(*env.score(probe, "assert left() == True\n"), "a later run saw the files")
    return out


def case_sysv_ipc(env: Env) -> list[str]:
    """A SysV shared-memory segment outlives its process unless the run has its own IPC namespace."""
    key = 0x5EED0000 + int(env.tag[:4], 16)
    prog = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"def add(a, b):\n    libc.shmget({key}, 4096, 0o1666)\n    return a + b\n")
    env.score(prog, ADD_TESTS)
    with open("/proc/sysvipc/shm") as fh:
        keys = [int(line.split()[0]) for line in fh.readlines()[1:]]
    if key in keys:
        subprocess.run(["ipcrm", "-M", str(key)], check=False)
        return [f"SysV shared memory key {key:#x} outlived the run"]
    return []


# ------------------------------------------------------------------ resources


def case_fork_bomb(env: Env) -> list[str]:
    """A fork bomb is capped and killed; the next run works."""
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    value, detail = env.score(bomb, ADD_TESTS)
    out = _scored(value, detail, "fork bomb")
    value, detail = env.score("def add(a, b):\n    return a + b\n", ADD_TESTS)
    return out + ([] if value == 1.0 else [f"a correct program after the fork bomb scored {value} ({detail})"])


def case_memory_split(env: Env) -> list[str]:
    """Three processes of 300 MB each must not fit a 512 MB limit for the run."""
    prog = ("import os, time\ndef hog():\n    kids = []\n    for _ in range(3):\n        pid = os.fork()\n"
            "        if pid == 0:\n            try:\n                blob = bytearray(b'\\x01') * (300 << 20)\n"
            "                time.sleep(1.0)\n                os._exit(0)\n            except BaseException:\n"
            "                os._exit(1)\n        kids.append(pid)\n"
            "    return all(os.waitpid(k, 0)[1] == 0 for k in kids)\n")
    return _scored(*env.score(prog, "assert hog() == True\n"), "900 MB in three processes under 512 MB")


def case_fill_disk(env: Env) -> list[str]:
    """Writing 256 MB into the work dir and the temp dirs must hit a quota."""
    prog = ("import os\ndef fill():\n    total = 0\n    chunk = b'x' * (1 << 20)\n"
            "    for d in ('.', '/tmp', '/var/tmp', '/dev/shm'):\n        for i in range(64):\n            try:\n"
            "                with open(os.path.join(d, f'f{i}'), 'wb') as fh:\n"
            "                    for _ in range(4):\n                        fh.write(chunk)\n                total += 4\n"
            "            except OSError:\n                break\n    return total >= 256\n")
    return _scored(*env.score(prog, "assert fill() == True\n"), "256 MB written")


def case_unreaped_next_run(env: Env) -> list[str]:
    """Processes left by one run must be gone (reaped) before the next run with that uid:
    a run fills its process cap with sleepers and returns; the next run needs threads."""
    from realscale.reward.code_reward import CodeReward

    filler = ("import os, time\ndef add(a, b):\n    for _ in range(13):\n        try:\n"
              "            if os.fork() == 0:\n                time.sleep(30)\n                os._exit(0)\n"
              "        except OSError:\n            break\n    return a + b\n")
    threads = ("import threading\ndef add(a, b):\n    ts = [threading.Thread(target=lambda: None) for _ in range(8)]\n"
               "    for t in ts:\n        t.start()\n    for t in ts:\n        t.join()\n    return a + b\n")
    out = []
    with CodeReward(**{**LIMITS, "concurrency": 1}) as one:
        for _ in range(3):
            results = one.score_batch([(filler, ADD_TESTS), (threads, ADD_TESTS)])
            if results[1].value != 1.0:
                out.append(f"the run after a process-filling run scored {results[1].value} ({results[1].detail[:200]})")
    return out


def case_output_flood(env: Env) -> list[str]:
    """Printing 200 MB is cut off; the reward still answers."""
    prog = "import sys\ndef add(a, b):\n    for _ in range(200):\n        sys.stdout.write('x' * (1 << 20))\n    return a + b\n"
    env.score(prog, ADD_TESTS)
    return []


# ------------------------------------------------------------------ other runs


def _victim(pairs: list[tuple[str, str]], started: Callable[[], None]) -> list[tuple[float, str]]:
    """Score ``pairs`` in a second reward process (a second trainer on the same host)."""
    proc = subprocess.Popen([sys.executable, __file__, "victim"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    proc.stdin.write(json.dumps(pairs))
    proc.stdin.close()
    assert proc.stdout.readline().strip() == "ready"
    started()
    out = proc.stdout.read()
    proc.wait(timeout=120)
    return [tuple(x) for x in json.loads(out)]


def case_cross_run_cwd(env: Env) -> list[str]:
    """Read another run's program through /proc/<pid>/cwd while it runs (another process)."""
    token = _token()
    victim = f"import time\nSECRET = {token!r}\ntime.sleep(3)\ndef add(a, b):\n    return a + b\n"
    spy = _search_program("for _ in range(60):\n" + "\n".join("    " + l for l in _PROC_ALL.strip().splitlines())
                          + "\n    import time; time.sleep(0.05)")
    out: list[str] = []

    def attack() -> None:  # a fresh reward, like the victim's: both draw their first sandbox uid
        time.sleep(0.5)
        with make_reward(concurrency=1) as fresh:
            (r,) = fresh.score_batch([(spy, _answer_tests(token))])
        out.extend(_scored(r.value, r.detail[:200], "reading another run's program"))

    t = threading.Thread(target=attack)
    _victim([(victim, ADD_TESTS)], t.start)
    t.join()
    return out


def case_cleanup_kills_other_run(env: Env) -> list[str]:
    """One process's cleanup must not kill another process's run (a correct answer then scores 0)."""
    victim = "import time\ntime.sleep(2)\ndef add(a, b):\n    return a + b\n"
    quick = "def add(a, b):\n    return a + b\n"
    results = _victim([(victim, ADD_TESTS)], lambda: env.reward.score_batch([(quick, ADD_TESTS)] * 8))
    value, detail = results[0]
    return [] if value == 1.0 else [f"a correct run in another process scored {value} ({detail})"]


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def run_battery(only: list[str] | None = None, workers: int = 6) -> dict[str, list[str]]:
    """Run the cases (concurrently) and return their violations by name, plus ``_python``:
    the interpreter the sandbox ran (as the program itself saw it)."""
    names = only or list(CASES)
    with make_reward() as reward:
        env = Env(reward)
        env.start()
        try:
            with ThreadPoolExecutor(workers) as ex:
                futures = {n: ex.submit(_guarded, CASES[n], env) for n in names}
                out = {n: f.result() for n, f in futures.items()}
        finally:
            env.stop()
        out["_python"] = [reward.sandbox.run_program("import sys; print(sys.executable)", reward.limits,
                                                     reward.sandbox.layers_for(False)).stdout.strip()]
        return out


def make_python_under_tmp() -> tuple[str, str]:
    """A Python installed under /tmp (this interpreter's binary and standard library,
    hard-linked when possible) and a venv under /tmp made from it, with
    --system-site-packages as CI venvs often are; returns (venv python, the tmp root).

    A decoy dataset in that Python's site-packages must stay out of the sandbox."""
    import shutil

    root = tempfile.mkdtemp(prefix="realscale-py-", dir="/tmp")
    base, ver = sys.base_prefix, f"python{sys.version_info[0]}.{sys.version_info[1]}"
    link = _hardlink_or_copy
    os.makedirs(os.path.join(root, "py", "bin"))
    link(os.path.realpath(os.path.join(base, "bin", ver)), os.path.join(root, "py", "bin", ver))
    stdlib = os.path.join(base, "lib", ver)
    shutil.copytree(stdlib, os.path.join(root, "py", "lib", ver), copy_function=link,
                    ignore=lambda d, names: ["site-packages", "test"] if d == stdlib else [])
    site = os.path.join(root, "py", "lib", ver, "site-packages")
    os.makedirs(site)
    with open(os.path.join(site, "decoy_dataset.jsonl"), "w") as fh:
        fh.write(json.dumps({"answer": _token()}) + "\n")
    venv = os.path.join(root, "venv")
    subprocess.run([os.path.join(root, "py", "bin", ver), "-m", "venv", "--system-site-packages", "--without-pip",
                    venv], check=True)
    return os.path.join(venv, "bin", "python"), root


def _hardlink_or_copy(src: str, dst: str) -> None:
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _guarded(fn: Callable[[Env], list[str]], env: Env) -> list[str]:
    try:
        return fn(env)
    except Exception as exc:  # noqa: BLE001 - a case that crashes is a finding, not a pass
        return [f"case raised {type(exc).__name__}: {exc}"]


def _main() -> None:
    mode = sys.argv[1]
    if mode == "victim":
        pairs = json.loads(sys.stdin.read())
        with make_reward() as reward:
            print("ready", flush=True)
            results = reward.score_batch([tuple(p) for p in pairs])
        print(json.dumps([(r.value, f"{r.reason}: {r.detail[:200]}") for r in results]))
    elif mode == "battery":
        only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
        print(json.dumps(run_battery(only)))
    else:
        raise SystemExit(f"unknown mode {mode!r}: battery or victim")


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    _main()

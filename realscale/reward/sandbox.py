"""Run an untrusted Python program in a sandbox and report how it ended.

What is contained (when running as root, as on our machines):
- **network**: the program runs in a new network namespace (only a down loopback), so
  sockets cannot connect anywhere, not even to the host's 127.0.0.1;
- **files**: the program runs as an unprivileged uid of its own (one per concurrent run),
  so it cannot write root-owned paths; in a private mount namespace /tmp, /var/tmp and
  /dev/shm are fresh small tmpfs, so the world-writable places vanish with it too. Its
  work dir (cwd) is the only persistent place it can write, and it is deleted afterwards;
- **resources**: rlimits on CPU seconds, address space, file size, open files, and process
  count (per uid, hence per run: a fork bomb hits the cap), plus a wall-clock timeout;
- **processes**: the run has its own session; at the end its process group and every
  process still owned by its uid are killed (catching children that called setsid);
- **secrets**: the environment is replaced by a minimal one; Python runs isolated (-I).

What is not contained: the program can *read* world-readable files (e.g. /etc, the
Python install, other users' world-readable data) and see other processes in /proc; it
shares the kernel (no seccomp filter, no PID namespace). Without root, or where
namespaces are refused, the missing layers are reported in :attr:`Isolation.missing` and
the program runs with what remains (rlimits, timeout, process-group kill, scrubbed env).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_exec.py")
_SETUP_FAILED = 126
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run."""

    timeout: float = 10.0  # wall-clock seconds
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file the program may write (stdout/stderr included)
    nproc: int = 16  # processes (threads count too) of the run's uid
    files: int = 64  # open file descriptors
    tmpfs_mb: int = 16  # size of each private /tmp, /var/tmp, /dev/shm
    max_output: int = 64 * 1024  # bytes of stdout/stderr kept in the result

    def __post_init__(self) -> None:
        for name in ("timeout", "memory_mb", "file_mb", "nproc", "files", "tmpfs_mb", "max_output"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"SandboxLimits.{name}: must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Isolation:
    """Which isolation layers this machine permits (probed once), and why any is missing."""

    net: bool
    mount: bool
    drop_user: bool
    missing: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunResult:
    """How a sandboxed run ended."""

    returncode: int | None  # None when killed at the wall timeout
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float

    @property
    def setup_failed(self) -> bool:
        return self.returncode == _SETUP_FAILED and self.stderr.startswith("sandbox set-up failed")


# ------------------------------------------------------------------ probing


_probe_lock = threading.Lock()
_probed: Isolation | None = None


def probe_isolation() -> Isolation:
    """Try each layer once with a trivial program; cache what works and why the rest fails."""
    global _probed
    with _probe_lock:
        if _probed is None:
            _probed = _probe()
        return _probed


def _probe() -> Isolation:
    """The strongest combination of layers under which a trivial program runs."""
    is_root = os.geteuid() == 0
    candidates = [(True, True, True), (True, True, False), (True, False, False), (False, False, False)]
    missing: dict[str, str] = {}
    if not is_root:
        candidates = candidates[2:]
        missing["mount"] = missing["drop_user"] = "not running as root"
    for net, mount, drop in candidates:
        trial = Isolation(net, mount, drop)
        result = _run("pass", SandboxLimits(timeout=30.0), trial, _UID_BASE if drop else None)
        if result.returncode == 0:
            return Isolation(net, mount, drop, missing)
        why = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        for layer, on in (("net", net), ("mount", mount), ("drop_user", drop)):
            if on:
                missing.setdefault(layer, why)
    return Isolation(False, False, False, missing)


def _closed_ancestor(path: str) -> str | None:
    """The top-most ancestor of ``path`` that other users cannot enter (e.g. /root), if any."""
    parts = os.path.abspath(path).split(os.sep)[1:]
    for i in range(1, len(parts) + 1):
        prefix = os.sep + os.path.join(*parts[:i])
        if not os.stat(prefix).st_mode & 0o001:
            return prefix
    return None


# ------------------------------------------------------------------ uids


_UID_BASE = 61000  # unprivileged ids without passwd entries; one per concurrent run


class _UidPool:
    """Hands out distinct uids so that concurrent runs never share a process count or files."""

    def __init__(self, base: int, size: int = 256) -> None:
        self._free = list(range(base, base + size))
        self._cond = threading.Condition()

    def take(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def give(self, uid: int) -> None:
        with self._cond:
            self._free.append(uid)
            self._cond.notify()


_uids = _UidPool(_UID_BASE + 1)


# ------------------------------------------------------------------ running


def run_python(source: str, limits: SandboxLimits | None = None) -> RunResult:
    """Run ``source`` as a Python program in the sandbox (see the module docstring)."""
    if not isinstance(source, str):
        raise TypeError(f"run_python: source must be str, got {type(source).__name__}")
    limits = limits or SandboxLimits()
    isolation = probe_isolation()
    uid = _uids.take() if isolation.drop_user else None
    try:
        return _run(source, limits, isolation, uid)
    finally:
        if uid is not None:
            _uids.give(uid)


def _spec(workdir: str, limits: SandboxLimits, isolation: Isolation, uid: int | None) -> dict:
    return {"workdir": workdir, "program": "program.py", "python": sys.executable, "env": SAFE_ENV,
            "net": isolation.net, "mount": isolation.mount, "uid": uid, "gid": uid,
            "cover": _closed_ancestor(sys.base_prefix) if (uid is not None and isolation.mount) else None,
            "expose": sys.base_prefix,
            "cpu_s": int(limits.timeout) + 1, "memory_mb": limits.memory_mb, "file_mb": limits.file_mb,
            "nproc": limits.nproc if uid is not None else 0, "files": limits.files, "tmpfs_mb": limits.tmpfs_mb}


def _run(source: str, limits: SandboxLimits, isolation: Isolation, uid: int | None) -> RunResult:
    workdir = tempfile.mkdtemp(prefix="realscale-sbx-")
    try:
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(source)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(path, uid, uid)
        os.chmod(workdir, 0o700)
        spec = json.dumps(_spec(workdir, limits, isolation, uid))
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            start = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-I", "-S", _LAUNCHER, spec], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, env=SAFE_ENV, start_new_session=True,
                                    close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_everything(proc, uid)
            wall = time.monotonic() - start
            return RunResult(None if timed_out else proc.returncode, _read(out, limits.max_output),
                             _read(err, limits.max_output), timed_out, wall)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _read(fh: "tempfile._TemporaryFileWrapper[bytes]", limit: int) -> str:  # type: ignore[name-defined]
    fh.seek(0)
    return fh.read(limit).decode("utf-8", errors="replace")


def _kill_everything(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill the run's process group, then every process its uid still owns, then reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        for _ in range(50):  # a fork bomb may fork between scans: repeat until none is left
            if not _kill_uid(uid):
                break
    proc.wait()


def _kill_uid(uid: int) -> bool:
    """SIGKILL every process whose real uid is ``uid``; True if any was found."""
    found = False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            os.kill(int(entry), signal.SIGKILL)
                            found = True
                        break
        except (OSError, ValueError):
            continue
    return found

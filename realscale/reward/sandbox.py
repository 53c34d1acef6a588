"""Run untrusted Python programs in a sandbox that never silently weakens.

The layers of isolation, each probed once per process (:meth:`Sandbox.probe`):

- ``uid``: the program runs as an unprivileged uid of its own. Uids are slots locked with
  ``flock`` in ``/run/realscale-sandbox/uids``, so concurrent runs, in this process or any
  other on the host, never share one; a slot is reused only after every process of its
  last run is gone (and leftovers of a crashed holder are killed first);
- ``pid``: a fresh PID namespace whose PID 1 is the program: /proc shows only the run, no
  other process can be signalled, and when PID 1 ends the kernel kills and reaps the rest
  (daemons, forks) before the run's end is reported;
- ``mount``: a minimal root: one tmpfs of ``disk_mb`` (the run's disk quota: work dir,
  /tmp, /var/tmp, /dev/shm, /run/lock all live in it and vanish with it) plus read-only
  binds of the interpreter, its standard library and the shared libraries it maps. No
  checkout, dataset, site-packages, caches or home directory. The interpreter is found
  wherever it is installed, /tmp included (a venv runs its base interpreter);
- ``net``: a network namespace with a down loopback (nothing reachable, not even the
  host's 127.0.0.1; abstract unix sockets are per namespace);
- ``ipc``: an IPC namespace (SysV shared memory / semaphores / queues vanish with the run);
- ``cgroup``: a cgroup per run (v2 where its controllers are delegated, else v1) with the
  memory limit and the process cap for the run as a whole (three 300 MB processes do not
  fit 512 MB). rlimits stay on each process too (address space, CPU s, file size, fds).

Policy (:meth:`Sandbox.layers_for`): when any layer is missing the run is refused
(:class:`SandboxRefused`; the code reward scores it 0 with reason ``sandbox``), unless the
caller explicitly allows a weaker sandbox; then the run uses what works and the caller
warns. A program never runs as root: if this process is root and the uid layer is
missing, every run is refused, allowed or not.

What it does not contain: the kernel is shared (no seccomp filter), so a kernel exploit is
out of scope; CPU time is bounded per process and by the wall timeout, not shared fairly;
the per-uid kernel keyring of a slot's uid persists between runs of that slot.

Without root (``mode == "userns"``, e.g. a Slurm job's reward workers), the layers are
:data:`USERNS_LAYERS`, all required the same way:

- ``userns``: each candidate process gets a user namespace of its own, the trainer's uid and
  gid mapped to themselves (the only ids an unprivileged process may map). The program runs
  as the trainer's uid with no capabilities (``execve`` as a non-zero uid clears them, plus
  no_new_privs), and ``user.max_user_namespaces`` is 0 inside, so it cannot make a user
  namespace of its own to regain them;
- ``pid``, ``mount``, ``net``, ``ipc``: as above, owned by that user namespace. The minimal
  root is the same, made read-only except the work dir and temp dirs (the tmpfs is the
  trainer uid's own, so without that it could write anywhere in it); binds keep the
  flags the host mount has (a user namespace cannot clear nosuid/noexec/ro). Where the
  host's /proc is partly covered (a container's masked paths) the kernel refuses a new
  /proc: the run then has none;
- ``nproc``: RLIMIT_NPROC, which Linux >= 5.14 counts per (user namespace, uid): the run's
  own tasks, capped at ``nproc``. Older kernels count every process of the uid on the
  host: the layer is missing there.

Where ``/proc/sys`` is read-only (a Docker container's default) the sandbox cannot set its
user namespace's ``max_user_namespaces`` to 0: ``userns`` is then missing, with that reason.

Weaker than root, and how: no uid of its own (what it can reach on the host is what the
trainer's uid could, through the namespaces: nothing but the interpreter's files, read-only;
its supplementary groups stay, ``setgroups`` being denied; whether the uid's kernel
keyrings are reachable from its user namespace is not checked); unless a cgroup is
delegated to the trainer (then used, as above), the run's memory is a watch, not a limit:
its reaper samples the resident memory of every process of the run's PID namespace every
20 ms and kills the run above ``memory_mb`` (a burst between samples can pass it; each
process is also capped by address space), and ``Isolation.notes`` says so;
the kernel attack surface of user namespaces is larger (a kernel bug reachable only with
namespace capabilities is reachable here). Where user namespaces are forbidden
(``user.max_user_namespaces=0``, ``kernel.unprivileged_userns_clone=0``, AppArmor's
``apparmor_restrict_unprivileged_userns``, a container's seccomp filter), the probe's
``unshare`` fails and every layer is missing, with that reason and the fix
(:func:`userns_hint`); ``realscale train`` refuses a code recipe then. A judge service
outside the job (SandboxFusion's way) is not built.

The machinery lives in ``_sandbox_exec.py`` (a helper process, forked per run); this
module owns the probe, the policy, the uid slots, the cgroups and the conversations.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from realscale.reward._sandbox_exec import MEMORY_TICK_S, kill_procs_of, kill_uid, recv_msg, send_msg, uid_pids

LAYERS = ("uid", "pid", "mount", "net", "ipc", "cgroup")  # as root
USERNS_LAYERS = ("userns", "pid", "mount", "net", "ipc", "nproc")  # without root (the cgroup: where delegated)
_EXEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_exec.py")
STATE_DIR = "/run/realscale-sandbox"
UID_BASE = 61000  # unprivileged ids without passwd entries: UID_BASE is the judges', slots above it
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
_RUN_IDS = itertools.count()
_GRACE_S = 20.0  # beyond a run's own timeouts before this side stops waiting for the helper


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run (``timeout`` per candidate process)."""

    timeout: float = 10.0  # wall-clock seconds of one candidate process
    memory_mb: int = 1024  # the run's memory (cgroup) and each process's address space
    file_mb: int = 16  # largest file one process may write
    nproc: int = 16  # processes and threads of the run
    files: int = 64  # open file descriptors per process
    disk_mb: int = 64  # everything the run writes (work dir, /tmp, /var/tmp, /dev/shm, /run/lock)
    max_output: int = 16 << 20  # bytes of stdout kept (and compared)
    max_stderr: int = 64 << 10  # bytes of stderr kept
    max_answer: int = 8 << 20  # bytes of one call's answer

    def __post_init__(self) -> None:
        for name in ("timeout", "memory_mb", "file_mb", "nproc", "files", "disk_mb", "max_output", "max_stderr",
                     "max_answer"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name}: must be a positive number, got {value!r}")

    def as_spec(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class Isolation:
    """Which layers this machine gives (probed once) and, for each missing one, why."""

    layers: dict[str, bool]
    missing: dict[str, str] = field(default_factory=dict)
    mode: str = "root"  # "root", or "userns" (unprivileged: user namespaces and rlimits)
    notes: dict[str, str] = field(default_factory=dict)  # what an optional layer lacks (not a refusal)

    @property
    def full(self) -> bool:
        return not self.missing

    def describe(self) -> str:
        return "; ".join(f"{k}: {v}" for k, v in self.missing.items()) or "all layers"


class SandboxRefused(RuntimeError):
    """A run refused because a layer is missing and no weaker sandbox was allowed."""


def choose_layers(iso: Isolation, allow_weaker: bool, is_root: bool) -> dict[str, bool]:
    """The policy: every layer, or refuse; the layers that work only when ``allow_weaker``;
    and never a program left running as root (root here without the uid layer)."""
    if iso.full:
        return dict(iso.layers)
    if is_root and not iso.layers.get("uid"):
        raise SandboxRefused(f"sandbox refused: cannot drop root for the program ({iso.missing.get('uid', '?')})")
    if not allow_weaker:
        raise SandboxRefused(f"sandbox refused: missing {iso.describe()} "
                             "(reward.code_sandbox_allow_weaker=true runs anyway, with a warning)")
    return dict(iso.layers)


@dataclass
class RunResult:
    """How one candidate process ended."""

    returncode: int | None  # None when killed at the timeout; negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    setup_error: str | None = None
    stdout_truncated: bool = False
    phases: dict[str, float] = field(default_factory=dict)  # seconds in set-up / run / reap, for diagnosis

    @property
    def setup_failed(self) -> bool:
        return self.setup_error is not None

    @classmethod
    def from_report(cls, r: dict) -> "RunResult":
        timed_out = bool(r.get("timed_out"))
        return cls(None if timed_out else r.get("status"), r.get("stdout", ""), r.get("stderr", ""), timed_out,
                   float(r.get("wall_s", 0.0)), r.get("setup_error"), bool(r.get("stdout_truncated")),
                   dict(r.get("phases") or {}))


@dataclass
class ServerOutcome:
    """How a calls / check run ended: the verdict (check) and the candidate process's end."""

    run: RunResult
    load_error: str | None = None
    verdict: dict | None = None
    answers: list = field(default_factory=list)


# ------------------------------------------------------------------ without root


def user_state_dir() -> str:
    """Where an unprivileged sandbox keeps its mount point: ``$XDG_RUNTIME_DIR`` or the temp
    dir, in a directory of this uid's own (checked: not a link, not another user's)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = runtime if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"realscale-sandbox-{os.getuid()}")


def _own_dir(path: str) -> None:
    """Create ``path`` (and its parent) 0700 or accept it only when it is this uid's own directory."""
    for d in (os.path.dirname(path), path):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise OSError(errno.EPERM, f"{d} is not a directory of uid {os.getuid()} that only it can write")


def nproc_per_userns(release: str | None = None) -> bool:
    """Whether the kernel counts RLIMIT_NPROC per user namespace (Linux >= 5.14, "ucounts"),
    so that a fresh user namespace's count holds only the run's own tasks."""
    try:
        major, minor = (int(x) for x in (release or os.uname().release).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


def _sysctl(name: str) -> str | None:
    try:
        with open("/proc/sys/" + name.replace(".", "/")) as fh:
            return fh.read().strip()
    except OSError:
        return None


def userns_hint() -> str:
    """What blocks unprivileged user namespaces here, as far as the sysctls say, and the fix."""
    fixes = []
    if _sysctl("kernel.unprivileged_userns_clone") == "0":
        fixes.append("kernel.unprivileged_userns_clone is 0: sysctl -w kernel.unprivileged_userns_clone=1")
    if _sysctl("user.max_user_namespaces") == "0":
        fixes.append("user.max_user_namespaces is 0: sysctl -w user.max_user_namespaces=15000")
    if _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        fixes.append("AppArmor restricts them: sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 or an "
                     "AppArmor profile allowing userns for this Python")
    if not fixes:
        fixes.append("no sysctl here forbids them: a container's seccomp filter or a user namespace above with "
                     "user.max_user_namespaces=0 may; allow user namespaces there")
    return "unprivileged user namespaces unavailable: " + "; ".join(fixes) + "; or run the trainer as root"


# ------------------------------------------------------------------ the sandbox


class Sandbox:
    """The probe, policy, uid slots, cgroups and root helper for one interpreter.

    Use :func:`shared_sandbox` (one per interpreter and process): the helper and the probe
    are costly, the slots must be shared.
    """

    def __init__(self, python: str | None = None, uid_base: int = UID_BASE, slots: int = 256,
                 state_dir: str | None = None) -> None:
        self.python = python or sys.executable
        self.uid_base = uid_base
        self.mode = "root" if os.geteuid() == 0 else "userns"
        self.state_dir = state_dir or (STATE_DIR if self.mode == "root" else user_state_dir())
        self._slots = _Slots(uid_base + 1, slots, os.path.join(self.state_dir, "uids"))
        self._cgroups: _Cgroups | None = None
        self._helper = _Helper()
        self._lock = threading.Lock()
        self._isolation: Isolation | None = None
        self._fs: dict | None = None
        self._exe = ""

    # ---------------------------------------------------------------- probe and policy

    def probe(self) -> Isolation:
        """Try each layer (once per process) and say exactly which are missing and why."""
        with self._lock:
            if self._isolation is None:
                self._isolation = self._probe()
            return self._isolation

    def layers_for(self, allow_weaker: bool) -> dict[str, bool]:
        """The layers a run uses, or :class:`SandboxRefused` with the reason."""
        return choose_layers(self.probe(), allow_weaker, os.geteuid() == 0)

    def _probe(self) -> Isolation:
        if self.mode == "userns":
            return self._probe_userns()
        missing: dict[str, str] = {}
        try:
            os.makedirs(os.path.join(self.state_dir, "root"), mode=0o755, exist_ok=True)
        except OSError as exc:
            for layer in ("uid", "mount"):
                missing.setdefault(layer, f"cannot create {self.state_dir}: {exc.strerror}")
        try:
            self._exe, self._fs = interpreter_plan(self.python)
            self._fs["root"] = os.path.join(self.state_dir, "root")
        except (OSError, RuntimeError, ValueError) as exc:
            raise SandboxRefused(f"sandbox refused: cannot inspect the interpreter {self.python}: {exc}") from None
        self._cgroups = _Cgroups(self.state_dir)
        if self._cgroups.why:
            missing["cgroup"] = self._cgroups.why
        layers = {layer: layer not in missing for layer in LAYERS}
        why = self._try(layers)
        if why is None:
            return Isolation(layers, missing)
        # Something failed together: try each layer alone, so each missing one names its own
        # reason; the uid on top of the minimal root when that works (an interpreter under
        # /root is reachable by another uid only through the root's binds).
        for layer in [name for name in LAYERS if layers[name] and name != "uid"] + ["uid"] * layers["uid"]:
            alone = {name: name == layer or (layer == "uid" and name == "mount" and "mount" not in missing)
                     for name in LAYERS}
            err = self._try(alone)
            if err is not None:
                missing[layer] = err
        layers = {layer: layer not in missing for layer in LAYERS}
        why = self._try(layers) if any(layers.values()) else None
        if why is not None:
            missing.setdefault("combined", why)
            layers = {layer: False for layer in LAYERS}
        return Isolation(layers, missing)

    def _probe_userns(self) -> Isolation:
        """Without root: every layer comes from a user namespace per candidate process, so
        when that fails, everything fails with its reason and the fix; else each layer alone."""
        self._inspect()
        missing: dict[str, str] = {}
        notes: dict[str, str] = {}
        try:
            _own_dir(os.path.join(self.state_dir, "root"))
        except OSError as exc:
            missing["mount"] = f"cannot use {self.state_dir}: {exc}"
        self._cgroups = _Cgroups(self.state_dir)
        if not nproc_per_userns():
            missing["nproc"] = (f"Linux {os.uname().release} counts RLIMIT_NPROC per uid across the host, not per "
                                "user namespace (needs Linux >= 5.14), so a run's processes cannot be capped")
        layers = {"uid": False, "cgroup": not self._cgroups.why,
                  **{layer: layer not in missing for layer in USERNS_LAYERS}}
        if self._try(layers) is not None:
            err = self._try({**{k: False for k in layers}, "userns": True})
            if err is not None:
                missing = {k: "needs the user namespace" for k in USERNS_LAYERS}
                hint = ("the sandbox needs a writable /proc/sys; or run the trainer as root"
                        if "cannot stop nested user namespaces" in err else userns_hint())
                missing["userns"] = f"{err} ({hint})"
                return Isolation({k: False for k in layers}, missing, "userns", {"cgroup": "not tried"})
            if layers["cgroup"] and self._try({**{k: False for k in layers}, "userns": True, "cgroup": True}):
                layers["cgroup"] = False
                self._cgroups.why = "a cgroup is delegated here but a user namespace cannot join it"
            for layer in [k for k in USERNS_LAYERS if layers[k] and k != "userns"]:
                err = self._try({**{k: False for k in layers}, "userns": True, layer: True})
                if err is not None:
                    missing[layer] = err
            layers.update({k: k not in missing for k in USERNS_LAYERS})
            why = self._try(layers)
            if why is not None:
                missing.setdefault("combined", why)
                layers = {k: False for k in layers}
        if not layers["cgroup"]:
            watched = layers["pid"] and layers["mount"] and self._sees_own_proc(layers)
            notes["cgroup"] = self._cgroups.why + (
                ": the run's memory is watched instead (the resident memory of its processes, sampled every "
                f"{MEMORY_TICK_S * 1000:.0f} ms: a burst between samples can pass it), each process capped by address "
                "space" if watched else ": memory is capped per process only (address space): no /proc in the "
                "sandbox here (the host's is partly covered), so the run's total is not watched")
        return Isolation(layers, missing, "userns", notes)

    def _sees_own_proc(self, layers: dict[str, bool]) -> bool:
        """Whether the run has a /proc of its own (which the memory watch reads)."""
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            return self.run_program("import os\nprint(os.path.isdir('/proc/1'))", SandboxLimits(timeout=30.0),
                                    layers).stdout.strip() == "True"
        return False

    def _inspect(self) -> None:
        try:
            self._exe, self._fs = interpreter_plan(self.python)
            self._fs["root"] = os.path.join(self.state_dir, "root")
        except (OSError, RuntimeError, ValueError) as exc:
            raise SandboxRefused(f"sandbox refused: cannot inspect the interpreter {self.python}: {exc}") from None

    def _try(self, layers: dict[str, bool]) -> str | None:
        """None if a trivial program runs under ``layers``, else why not."""
        try:
            result = self.run_program("pass", SandboxLimits(timeout=30.0), layers)
        except (OSError, RuntimeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        if result.returncode == 0:
            return None
        return result.setup_error or (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]

    # ---------------------------------------------------------------- the forms of a run

    def run_program(self, source: str, limits: SandboxLimits, layers: dict[str, bool]) -> RunResult:
        """Run ``source`` as a script with empty stdin (no verdict: how it ended, and its output)."""
        return self.run_stdio(source, [""], limits, layers, lambda i, r: False)[0]

    def run_stdio(self, source: str, inputs: list[str], limits: SandboxLimits, layers: dict[str, bool],
                  judge: Callable[[int, RunResult], bool]) -> list[RunResult]:
        """One process per input; ``judge(i, result)`` False stops the rest."""
        results: list[RunResult] = []
        with self._conversation({"form": "stdio", "program": source, "inputs": inputs}, limits, layers,
                                backstop=limits.timeout * len(inputs)) as conv:
            while True:
                msg = conv.recv()
                if msg.get("done"):
                    return results
                results.append(RunResult.from_report(msg))
                conv.send({"next": bool(judge(len(results) - 1, results[-1]))})

    def run_calls(self, source: str, fn: str, calls: list[tuple[object, object]], limits: SandboxLimits,
                  layers: dict[str, bool], judge: Callable[[int, str | None], bool]) -> ServerOutcome:
        """Call ``fn`` of the program with each ``(args, kwargs)`` (plain-data trees);
        ``judge(i, raw_answer_line)`` False stops the rest."""
        with self._conversation({"form": "calls", "program": source, "fn": fn, "calls": calls}, limits, layers,
                                backstop=limits.timeout) as conv:
            answers: list = []
            while True:
                msg = conv.recv()
                if msg.get("done"):
                    return _server_outcome(msg, answers)
                answers.append(msg.get("response"))
                conv.send({"next": bool(judge(len(answers) - 1, answers[-1]))})

    def run_check(self, source: str, test: str, entry_point: str | None, prelude: str, names: list[str],
                  limits: SandboxLimits, layers: dict[str, bool]) -> ServerOutcome:
        """Run trusted ``test`` code (after ``prelude``) as the judge; each of ``names`` it
        uses (and ``check(entry_point)``'s argument) calls into the program."""
        spec = {"form": "check", "program": source, "test": test, "entry_point": entry_point, "prelude": prelude,
                "names": names}
        with self._conversation(spec, limits, layers, backstop=limits.timeout) as conv:
            return _server_outcome(conv.recv(), [])

    # ---------------------------------------------------------------- one conversation

    @contextlib.contextmanager
    def _conversation(self, spec: dict, limits: SandboxLimits, layers: dict[str, bool],
                      backstop: float) -> Iterator["_Conversation"]:
        if self._fs is None:
            self.probe()
        uid = self._slots.acquire(self._cgroups, layers) if layers.get("uid") else None
        cgroup: list[str] | None = None
        conv: _Conversation | None = None
        try:
            if layers.get("cgroup"):
                name = f"u{uid}" if uid is not None else f"p{os.getpid()}-{next(_RUN_IDS)}"
                cgroup = self._cgroups.create(name, limits)
            spec.update({"layers": {**dict.fromkeys(LAYERS + USERNS_LAYERS, False), **layers}, "mode": self.mode,
                         "uid": uid, "judge_uid": self.uid_base if layers.get("uid") else None,
                         "host_uid": os.geteuid(), "host_gid": os.getegid(),
                         "cgroup": cgroup, "fs": self._fs, "python": self._exe, "env": SAFE_ENV,
                         "limits": limits.as_spec()})
            conv = _Conversation(self._helper.open_run(self.python), backstop + _GRACE_S)
            conv.send(spec)
            conv.pid = int(conv.recv()["pid"])
            yield conv
        finally:
            if conv is not None:
                conv.close()
            self._cleanup(conv, uid, cgroup)

    def _cleanup(self, conv: "_Conversation | None", uid: int | None, cgroup: list[str] | None) -> None:
        """After the run: its processes are gone (made sure of if it did not end cleanly),
        its cgroup removed, its uid slot free."""
        if conv is not None and not conv.finished and conv.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(conv.pid, signal.SIGKILL)  # L: its death makes every C kill its G
        if cgroup is not None:
            for procs in cgroup:
                kill_procs_of(procs)
            if uid is None:  # a one-off name; a uid slot's cgroup stays for its next run
                self._cgroups.remove(cgroup)
        if uid is not None:
            if conv is None or not conv.finished:
                kill_uid(uid)
                _wait_uid_gone(uid)
            self._slots.release(uid)


class _Conversation:
    """The socket to one run's leader, with a deadline on every answer."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock, self.pid, self.finished = sock, 0, False
        sock.settimeout(timeout)

    def send(self, obj: dict) -> None:
        send_msg(self.sock, obj)

    def recv(self) -> dict:
        try:
            msg = recv_msg(self.sock)
        except socket.timeout:
            raise TimeoutError("the sandbox helper stopped answering") from None
        if msg is None:
            raise RuntimeError("the sandbox helper ended the run without an answer")
        if msg.get("done"):
            self.finished = True
            if msg.get("error"):
                raise RuntimeError(msg["error"])
        return msg

    def close(self) -> None:
        self.sock.close()


def _server_outcome(msg: dict, answers: list) -> ServerOutcome:
    run = RunResult.from_report({**msg.get("report", {}), "stderr": msg.get("stderr", "")})
    load = msg.get("load") or {}
    return ServerOutcome(run, load.get("load_error"), msg.get("verdict"), answers)


def _wait_uid_gone(uid: int, timeout: float = 10.0) -> None:
    """Until no process (not even a zombie) of ``uid`` is left: the slot's nproc count is then 0."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not uid_pids(uid):
            return
        time.sleep(0.01)


_SHARED: dict[tuple[str, int], Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(python: str | None = None, uid_base: int = UID_BASE) -> Sandbox:
    """The process-wide :class:`Sandbox` for this interpreter and uid range."""
    key = (python or sys.executable, uid_base)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Sandbox(key[0], uid_base)
        return _SHARED[key]


def probe_isolation(python: str | None = None) -> Isolation:
    """What the shared sandbox of ``python`` (default: this interpreter) can isolate here."""
    return shared_sandbox(python).probe()


# ------------------------------------------------------------------ the root helper


class _Helper:
    """The zygote process (``_sandbox_exec.py serve``), started on first use and restarted
    if it died or this process forked; each run gets a socket pair, one end sent to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ctl: socket.socket | None = None
        self._owner = 0

    def open_run(self, python: str) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._lock:
                for attempt in range(2):
                    self._ensure()
                    try:
                        socket.send_fds(self._ctl, [b"run"], [theirs.fileno()])
                        break
                    except OSError:
                        if attempt:
                            raise
                        self._stop()
        finally:
            theirs.close()
        return ours

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.poll() is None and self._owner == os.getpid():
            return
        self._stop()
        ctl, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The helper is the trainer's own interpreter (it needs nothing but the standard
        # library); -I keeps the environment and user site out of it.
        self._proc = subprocess.Popen([sys.executable, "-I", _EXEC, "serve", str(child.fileno())],
                                      pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=SAFE_ENV,
                                      start_new_session=True)
        child.close()
        self._ctl, self._owner = ctl, os.getpid()

    def _stop(self) -> None:
        if self._ctl is not None and self._owner == os.getpid():
            self._ctl.close()
        if self._proc is not None and self._owner == os.getpid():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        self._proc = self._ctl = None


# ------------------------------------------------------------------ uid slots


class _Slots:
    """Sandbox uids, each held by an exclusive ``flock`` on its own lock file for the length
    of a run: distinct across threads, processes and trainers on the host; released by the
    kernel if the holder dies."""

    def __init__(self, base: int, count: int, lock_dir: str) -> None:
        self.base, self.count, self.lock_dir = base, count, lock_dir
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()

    def acquire(self, cgroups: "_Cgroups | None", layers: dict[str, bool]) -> int:
        os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
        while True:
            for uid in range(self.base, self.base + self.count):
                fd = os.open(os.path.join(self.lock_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                with self._lock:
                    self._held[uid] = fd
                self._clear_leftovers(uid, cgroups, layers)
                return uid
            time.sleep(0.01)  # every slot busy: wait for one

    @staticmethod
    def _clear_leftovers(uid: int, cgroups: "_Cgroups | None", layers: dict[str, bool]) -> None:
        """A slot whose last holder crashed may still have processes: kill them first."""
        stale = cgroups is not None and cgroups.populated(f"u{uid}")
        if stale:
            for procs in cgroups.paths(f"u{uid}"):
                kill_procs_of(procs)
        if stale or not layers["cgroup"]:
            kill_uid(uid)
            _wait_uid_gone(uid)

    def release(self, uid: int) -> None:
        with self._lock:
            fd = self._held.pop(uid)
        os.close(fd)


# ------------------------------------------------------------------ cgroups


class _Cgroups:
    """One cgroup per run under ``<this process's cgroup>/realscale-sandbox``: cgroup v2 if
    memory and pids are delegated there, else the v1 memory and pids hierarchies."""

    def __init__(self, state_dir: str) -> None:
        self.why = ""
        self.version = 0
        self.bases: list[str] = []
        reasons = []
        for version, find in ((2, _v2_bases), (1, _v1_bases)):
            try:
                self.bases, self.version = find(), version
                self.remove(self.create(f"probe-{os.getpid()}", SandboxLimits()))  # can we, really?
                return
            except OSError as exc:
                reasons.append(f"v{version}: {exc.strerror or exc}")
        self.why = "no usable cgroup (" + "; ".join(reasons) + ")"

    def paths(self, name: str) -> list[str]:
        return [os.path.join(base, name, "cgroup.procs") for base in self.bases]

    def populated(self, name: str) -> bool:
        """Whether cgroup ``name`` exists and holds a process."""
        for procs in self.paths(name):
            with contextlib.suppress(FileNotFoundError), open(procs) as fh:
                if fh.read().strip():
                    return True
        return False

    def create(self, name: str, limits: SandboxLimits) -> list[str]:
        """The run's cgroup (its ``cgroup.procs`` files) with its memory and process limits.
        A uid slot keeps its cgroup from run to run (mkdir/rmdir of a memory cgroup can take
        hundreds of ms on a loaded machine); it is empty between runs."""
        memory, pids = str(limits.memory_mb << 20), str(limits.nproc)
        for base in self.bases:
            d = os.path.join(base, name)
            os.makedirs(d, exist_ok=True)
            if self.version == 2:
                _write(d, "memory.max", memory)
                _write(d, "memory.swap.max", "0", optional=True)
                _write(d, "pids.max", pids)
            elif os.path.exists(os.path.join(d, "memory.limit_in_bytes")):
                # memory + swap must stay >= memory at each step, whichever way the limit moves
                _write(d, "memory.memsw.limit_in_bytes", "-1", optional=True)
                _write(d, "memory.limit_in_bytes", memory)
                _write(d, "memory.memsw.limit_in_bytes", memory, optional=True)
            else:
                _write(d, "pids.max", pids)
        return self.paths(name)

    def remove(self, procs_files: list[str]) -> None:
        for procs in procs_files:
            d = os.path.dirname(procs)
            for _ in range(200):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY: the last process is still leaving
                    if exc.errno != errno.EBUSY:
                        raise
                    kill_procs_of(procs)
                    time.sleep(0.005)


def _write(d: str, name: str, value: str, optional: bool = False) -> None:
    try:
        with open(os.path.join(d, name), "w") as fh:
            fh.write(value)
    except FileNotFoundError:
        if not optional:
            raise


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and ``""`` for v2."""
    out = {}
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _mounts(fstype: str) -> list[tuple[str, set[str]]]:
    """(mount point, super options) of every mount of ``fstype``."""
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, right = line.split(" - ", 1)
            kind, _, options = right.split()[:3]
            if kind == fstype:
                found.append((left.split()[4], set(options.split(","))))
    return found


def _make_base(parent: str) -> str:
    base = os.path.join(parent, "realscale-sandbox")
    os.makedirs(base, exist_ok=True)
    return base


def _v2_bases() -> list[str]:
    own = _own_cgroups().get("")
    mounts = _mounts("cgroup2")
    if own is None or not mounts:
        raise OSError(errno.ENOENT, "no cgroup2 mount")
    parent = mounts[0][0] + own
    with open(os.path.join(parent, "cgroup.controllers")) as fh:
        have = set(fh.read().split())
    if not {"memory", "pids"} <= have:
        raise OSError(errno.ENOTSUP, f"memory and pids not delegated to {parent} (it has: {' '.join(sorted(have)) or 'none'})")
    base = _make_base(parent)
    for d in (parent, base):
        _write(d, "cgroup.subtree_control", "+memory +pids")
    return [base]


def _v1_bases() -> list[str]:
    own = _own_cgroups()
    bases = []
    for controller in ("memory", "pids"):
        mount = next((m for m, opts in _mounts("cgroup") if controller in opts), None)
        if mount is None or controller not in own:
            raise OSError(errno.ENOENT, f"no v1 {controller} hierarchy")
        bases.append(_make_base(mount + own[controller]))
    return bases


# ------------------------------------------------------------------ the interpreter's files


_PROBE = r"""
import importlib, json, os, site, sys, sysconfig
for d in [p for p in sys.path if p.endswith("lib-dynload") and os.path.isdir(p)]:
    for f in sorted(os.listdir(d)):
        if f.endswith(".so"):
            try:
                importlib.import_module(f.split(".")[0])
            except BaseException:
                pass
maps = set()
with open("/proc/self/maps") as fh:
    for line in fh:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and not parts[5].rstrip().endswith("(deleted)"):
            maps.add(parts[5].rstrip("\n"))
print(json.dumps({"executable": sys.executable, "base": getattr(sys, "_base_executable", sys.executable),
                  "prefix": sys.base_prefix, "path": sys.path, "maps": sorted(maps),
                  "site": site.getsitepackages() + [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]}))
"""


def _ask(python: str) -> dict:
    out = subprocess.run([python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=120,
                         env=SAFE_ENV)
    if out.returncode != 0:
        raise RuntimeError((out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1])
    return json.loads(out.stdout)


def interpreter_plan(python: str) -> tuple[str, dict]:
    """The interpreter to exec in the sandbox (a venv's base interpreter) and the mount plan
    that makes it run in an otherwise empty root: read-only binds of the executable, the
    standard library and the shared libraries it maps (by directory outside its prefix), the
    symlinks on the way to each, and empty covers over any site-packages inside those."""
    first = _ask(python)
    exe = os.path.realpath(first["base"])
    info = _ask(exe) if exe != os.path.realpath(first["executable"]) else first
    prefix = os.path.realpath(info["prefix"])
    private = {prefix} | {os.path.join(prefix, d) for d in ("bin", "lib", "lib64")}
    plan = _Plan()
    plan.expose(exe, as_dir=False)
    for entry in info["path"]:
        if os.path.exists(entry):
            plan.expose(entry, as_dir=os.path.isdir(entry))
    interp = elf_interpreter(exe)
    if os.path.exists("/etc/ld.so.cache"):  # where the loader looks libraries up first
        plan.expose("/etc/ld.so.cache", as_dir=False)
    for lib in ([interp] if interp else []) + info["maps"]:
        if not os.path.exists(lib):
            continue
        real = os.path.realpath(lib)
        plan.walk(lib)
        # A library next to the interpreter's own package dirs (prefix/lib holds pythonX.Y and
        # with it site-packages) is bound alone; a system library dir is bound whole, so that
        # what the loader opens lazily (libgcc_s for thread exit, ...) is there too.
        alone = os.path.dirname(real) in private
        plan.expose(real if alone else os.path.dirname(real), as_dir=not alone)
    for name in sorted(os.listdir("/")):  # /lib -> usr/lib and the like, as the loader expects
        if os.path.islink("/" + name):
            plan.symlink("/" + name, os.readlink("/" + name))
    for entry in info["site"]:
        plan.cover(os.path.realpath(entry))
    for bound in list(plan.dirs):
        for name in ("site-packages", "dist-packages"):
            plan.cover(os.path.join(bound, name))
    return exe, {"plan": plan.ops(), "scratch": tempfile.gettempdir()}


class _Plan:
    """Mount operations, deduplicated: binds (files or dirs), symlinks, covers."""

    def __init__(self) -> None:
        self.dirs: set[str] = set()
        self.files: set[str] = set()
        self.links: dict[str, str] = {}
        self.covers: set[str] = set()

    def inside_bound(self, path: str) -> bool:
        return any(path == d or path.startswith(d + os.sep) for d in self.dirs)

    def walk(self, path: str, depth: int = 0) -> str:
        """Record each symlink on the way to ``path``; return its real path."""
        if depth > 40:
            raise ValueError(f"too many symlinks resolving {path}")
        parts = os.path.abspath(path).strip("/").split("/")
        cur = "/"
        for i, part in enumerate(parts):
            nxt = os.path.join(cur, part)
            if os.path.islink(nxt):
                target = os.readlink(nxt)
                self.symlink(nxt, target)
                rest = parts[i + 1:]
                return self.walk(os.path.normpath(os.path.join(cur, target, *rest)), depth + 1)
            cur = nxt
        return cur

    def symlink(self, path: str, target: str) -> None:
        self.links.setdefault(path, target)

    def expose(self, path: str, as_dir: bool) -> None:
        real = self.walk(path)
        if self.inside_bound(real):
            return
        if as_dir:
            for d in [d for d in self.dirs if d.startswith(real + os.sep)]:
                self.dirs.discard(d)
            self.dirs.add(real)
        else:
            self.files.add(real)

    def cover(self, path: str) -> None:
        if os.path.isdir(path) and self.inside_bound(path) and path not in self.dirs:
            self.covers.add(path)

    def ops(self) -> list[list[str]]:
        binds = sorted(self.dirs | {f for f in self.files if not self.inside_bound(f)})
        links = sorted(p for p in self.links if not self.inside_bound(p) and p not in binds)
        return ([["bind", p] for p in binds] + [["symlink", p, self.links[p]] for p in links]
                + [["cover", p] for p in sorted(self.covers)])


def elf_interpreter(path: str) -> str | None:
    """The ELF program interpreter (PT_INTERP) of ``path``, e.g. /lib64/ld-linux-x86-64.so.2."""
    with open(path, "rb") as fh:
        head = fh.read(64)
        if head[:4] != b"\x7fELF":
            return None
        end = "<" if head[5] == 1 else ">"
        if head[4] == 2:  # 64-bit: e_phoff at 32; p_offset at 8, p_filesz at 32 of each entry
            (phoff,), (size, count) = struct.unpack(end + "Q", head[32:40]), struct.unpack(end + "HH", head[54:58])
            fields = (end + "Q", 8, 32)
        else:  # 32-bit: e_phoff at 28; p_offset at 4, p_filesz at 16
            (phoff,), (size, count) = struct.unpack(end + "I", head[28:32]), struct.unpack(end + "HH", head[42:46])
            fields = (end + "I", 4, 16)
        fmt, at_offset, at_size = fields
        width = struct.calcsize(fmt)
        for i in range(count):
            fh.seek(phoff + i * size)
            ph = fh.read(size)
            if struct.unpack(end + "I", ph[:4])[0] == 3:  # PT_INTERP
                (offset,) = struct.unpack(fmt, ph[at_offset:at_offset + width])
                (length,) = struct.unpack(fmt, ph[at_size:at_size + width])
                fh.seek(offset)
                return fh.read(length).rstrip(b"\0").decode()
    return None

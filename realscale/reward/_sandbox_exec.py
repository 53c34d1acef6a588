"""The privileged side of the sandbox: builds each run's jail and moves its data.

Started once per trainer process as ``python -I _sandbox_exec.py serve`` (the *zygote* Z) by
:mod:`realscale.reward.sandbox`, which talks to it over a unix socket. Standard library
only (no realscale import: it runs with ``-I``); Python is never run between ``fork`` and
``exec`` of a threaded process: Z is single-threaded and every fork below is of it or of
its single-threaded children.

One run, process by process (P is the trainer's reward thread):

    P ─socket─ Z ──fork── L   run leader: reads the run's spec from P, answers P's questions
                          ├─ C   one per candidate process: enters a fresh PID namespace,
                          │  │   enforces the deadline, reaps G, reports how it ended
                          │  └─ G   PID 1 of that namespace: joins the run's cgroup, takes new
                          │         mount/net/ipc/uts/cgroup namespaces, builds a minimal root
                          │         (tmpfs with a size limit + read-only binds of the
                          │         interpreter), pivots into it, sets rlimits, drops to the
                          │         run's uid, execs Python
                          └─ J   check form only: runs the dataset's test code as an
                                 unprivileged judge uid, calling the candidate over pipes

Without root (``spec["mode"] == "userns"``) the same tree runs as the trainer's uid: C first
enters a user namespace of its own (its uid and gid mapped to themselves, setgroups denied,
``user.max_user_namespaces`` 0 inside so nothing in it can make another), which gives it
the capabilities to take the PID namespace and G those to build the same minimal root; G's
``execve`` as a non-zero uid then clears every capability. Limits are rlimits (the process
cap counts the run's tasks in that user namespace, Linux >= 5.14) plus a cgroup only where
one is delegated; without one C samples the run's resident memory (``run_rss``) and kills
it above the limit. J takes a user + network namespace of its own and drops its capabilities.

Why each piece: G is PID 1, so when it dies the kernel kills every process of the run and
C's ``waitpid`` returns only once all of them are reaped (no daemon, no unreaped process
survives into the next run of that uid). C runs outside the namespace, so the candidate
cannot see or signal it. The candidate's verdict never comes from G: stdout is read by L
from a memfd after G is gone, and call results cross a pipe as plain data (``plain.py``)
that P or J decodes and compares.

Message framing on the P socket: 4-byte big-endian length + JSON (``send_msg``/``recv_msg``).
"""

import contextlib
import ctypes
import fcntl
import json
import os
import platform
import resource
import select
import signal
import socket
import struct
import sys
import time
import types

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWUSER = 0x00020000, 0x02000000, 0x04000000, 0x10000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
ST_RELATIME = 4096  # statvfs's f_flag; ST_RDONLY..ST_NOEXEC, ST_NOATIME, ST_NODIRATIME equal their MS_ flags
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SETUP_FAILED = 126
HERE = os.path.dirname(os.path.abspath(__file__))
MEMORY_TICK_S = 0.02  # how often a user's sandbox samples the run's memory (no cgroup)
_PAGE = os.sysconf("SC_PAGE_SIZE")
_HIGH_FD = 512  # fds are staged above this before being placed at 0..4
_libc = ctypes.CDLL(None, use_errno=True)


# ------------------------------------------------------------------ framing


def send_msg(sock, obj):
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_msg(sock, limit=1 << 30):
    """The next message, or None at EOF."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">I", head)
    if size > limit:
        raise ValueError(f"message of {size} bytes > {limit}")
    body = _recv_exact(sock, size)
    if body is None:
        return None
    return json.loads(body)


def _recv_exact(sock, n):
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------ small system helpers


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, dst, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")


def unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def enter_userns(uid, gid, nested=0):
    """Unprivileged: a new user namespace where ``uid``/``gid`` map to themselves (the only
    ids an unprivileged process may map), with all capabilities over what it then creates,
    and at most ``nested`` user namespaces below it."""
    unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1\n"), ("gid_map", f"{gid} {gid} 1\n")):
        with open("/proc/self/" + name, "w") as fh:
            fh.write(text)
    try:
        with open("/proc/sys/user/max_user_namespaces", "w") as fh:
            fh.write(f"{nested}\n")
    except OSError as exc:  # e.g. a container's read-only /proc/sys: then the program could nest
        raise OSError(exc.errno, f"cannot stop nested user namespaces (user.max_user_namespaces={nested} in the "
                                 f"sandbox's own user namespace): {exc.strerror}") from None


def drop_caps():
    """Clear this process's capabilities (effective, permitted, inheritable)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(header, data), "capset")


def _pivot_root(new_root):
    """Make ``new_root`` the root and drop the old one (pivot_root(".", ".") + lazy umount)."""
    os.chdir(new_root)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:  # no syscall number known here: move the mount over / and chroot
        _mount(".", "/", None, MS_MOVE)
        os.chroot(".")
    else:
        _check(_libc.syscall(ctypes.c_long(number), b".", b"."), "pivot_root")
        _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")


def kill_procs_of(procs_file, rounds=200):
    """SIGKILL every process listed in a cgroup's ``cgroup.procs`` until it is empty."""
    for _ in range(rounds):
        try:
            with open(procs_file) as fh:
                pids = [int(p) for p in fh.read().split()]
        except FileNotFoundError:
            return True
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return False


def uid_pids(uid):
    """Every process (zombies too) whose real uid is ``uid``."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _uid_of(e) == uid]


def kill_uid(uid, rounds=50):
    """SIGKILL every process whose real uid is ``uid`` (repeat: a fork bomb forks between scans)."""
    for _ in range(rounds):
        found = False
        for pid in uid_pids(uid):
            try:
                os.kill(pid, signal.SIGKILL)
                found = True
            except ProcessLookupError:
                pass
        if not found:
            return
        time.sleep(0.005)


def _uid_of(pid):
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _close_all_but(keep):
    keep = sorted(set(keep))
    low = 3
    for fd in keep:
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, 1 << 16)


def _memfd(data=b""):
    fd = os.memfd_create("sbx", os.MFD_CLOEXEC)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _load_sibling(name):
    """A stdlib-only sibling module (``plain.py``) loaded from source, and that source."""
    with open(os.path.join(HERE, name), encoding="utf-8") as fh:
        source = fh.read()
    module = types.ModuleType(name[:-3])
    exec(compile(source, os.path.join(HERE, name), "exec"), module.__dict__)
    return module, source


# ------------------------------------------------------------------ G: become the candidate


def _join_cgroup(spec):
    for procs in spec["cgroup"] or ():
        with open(procs, "w") as fh:
            fh.write("0")


def _namespaces(layers):
    flags = 0
    for layer, flag in (("mount", CLONE_NEWNS | CLONE_NEWUTS), ("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC),
                        ("cgroup", CLONE_NEWCGROUP)):
        if layers[layer]:
            flags |= flag
    return flags


def _mkdir(path, mode=0o755, owner=None):
    os.makedirs(path, mode=0o755, exist_ok=True)
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner, owner)


def _bind(src, dst, flags=MS_RDONLY | MS_NOSUID | MS_NODEV, keep=False):
    os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
    if os.path.isdir(src):
        os.makedirs(dst, mode=0o755, exist_ok=True)
    elif not os.path.exists(dst):
        os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(src, dst, None, MS_BIND)
    if keep:  # in a user namespace the source's flags are locked: a remount must repeat them
        flags |= _source_flags(dst)
    _mount(None, dst, None, MS_BIND | MS_REMOUNT | flags)


def _source_flags(path):
    have = os.statvfs(path).f_flag
    flags = have & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NODIRATIME)
    if have & MS_NOATIME:
        return flags | MS_NOATIME
    return flags | (MS_RELATIME if have & ST_RELATIME else MS_STRICTATIME)


def _build_root(spec):
    """A tmpfs root of ``disk_mb`` holding only: the interpreter (read-only binds), /proc of
    this PID namespace, a few /dev nodes, empty /tmp /var/tmp /dev/shm /run/lock and the
    work dir. Everything it writes lives in that one tmpfs, so the size is the run's quota
    and the whole of it vanishes with the mount namespace."""
    root, limits, uid = spec["fs"]["root"], spec["limits"], spec["uid"]
    keep = spec.get("mode") == "userns"
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    inodes = max(1024, limits["disk_mb"] * 64)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits['disk_mb']}m,nr_inodes={inodes},mode=755")
    for d in ("/tmp", "/var/tmp", "/run/lock", "/dev/shm"):
        _mkdir(root + d, 0o1777)
    os.symlink("../run/lock", root + "/var/lock")
    _mkdir(root + "/sandbox", 0o700, uid)
    for op in spec["fs"]["plan"]:
        kind, path = op[0], op[1]
        if kind == "symlink":
            os.makedirs(os.path.dirname(root + path), mode=0o755, exist_ok=True)
            os.symlink(op[2], root + path)
        elif kind == "bind":
            _bind(path, root + path, keep=keep)
        elif kind == "cover":  # e.g. site-packages inside the stdlib dir: an empty read-only tmpfs
            _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
    for node in ("null", "zero", "full", "random", "urandom"):
        _bind("/dev/" + node, root + "/dev/" + node, MS_NOSUID | MS_NOEXEC, keep=keep)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    _mkdir(root + "/proc")
    # In a PID namespace this /proc shows the run's processes only; without one, hidepid
    # hides every process of another uid.
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               None if spec["layers"]["pid"] else "hidepid=2")
    except OSError:
        # In a user namespace the kernel refuses a new /proc where the host's is partly
        # covered (a container's masked paths): then the run has none (an empty dir).
        if not keep:
            raise
    if keep:  # the skeleton is this uid's own tmpfs: only the work and temp dirs stay writable
        for d in ("/sandbox", "/tmp", "/var/tmp", "/run/lock", "/dev/shm"):
            _mount(root + d, root + d, None, MS_BIND)
        _mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _pivot_root(root)
    _libc.sethostname(b"sandbox", ctypes.c_size_t(7))


def _limit(spec):
    lim, mb = spec["limits"], 1 << 20
    for res, value in ((resource.RLIMIT_CPU, int(lim["timeout"]) + 1), (resource.RLIMIT_AS, lim["memory_mb"] * mb),
                       (resource.RLIMIT_FSIZE, lim["file_mb"] * mb), (resource.RLIMIT_NOFILE, lim["files"]),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    if spec["uid"] is not None:  # per uid, and the uid is the run's own: a cap for the run
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    elif spec["layers"].get("nproc"):  # counted per (user namespace, uid): the run's tasks, and C
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"] + 1, lim["nproc"] + 1))


def _drop(uid):
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def _install_fds(fds, err_fd):
    """Place ``fds`` ({target: source}) at their targets; close everything else but the
    error pipe (staged high, close-on-exec)."""
    err = fcntl.fcntl(err_fd, fcntl.F_DUPFD_CLOEXEC, _HIGH_FD)
    staged = {t: fcntl.fcntl(s, fcntl.F_DUPFD_CLOEXEC, _HIGH_FD + 1) for t, s in fds.items()}
    for target, source in staged.items():
        os.dup2(source, target, inheritable=True)
    _close_all_but(list(fds) + [err])
    return err


def _become_candidate(spec, argv, fds, err):
    layers = spec["layers"]
    if layers["cgroup"]:
        _join_cgroup(spec)
    flags = _namespaces(layers)
    if flags:
        unshare(flags)
    if not layers["pid"]:
        os.setsid()  # without a PID namespace, the process group is the handle to kill
    if layers["mount"]:
        _build_root(spec)
        os.chdir("/sandbox")
        with open("program.py", "w", encoding="utf-8") as fh:
            fh.write(spec["program"])
        if spec["uid"] is not None:
            os.chown("program.py", spec["uid"], spec["uid"])
    else:
        os.chdir(spec["workdir"])
    err[0] = _install_fds(fds, err[0])
    _limit(spec)
    _drop(spec["uid"])
    os.execve(spec["python"], argv, spec["env"])


# ------------------------------------------------------------------ C: reap and time G


class Candidate:
    """L's handle on one candidate process (C, which owns G)."""

    def __init__(self, pid, ctl_w, report_r):
        self.pid, self.ctl_w, self.report_r = pid, ctl_w, report_r
        self.report = None

    def stop(self):
        """Ask C to kill G now (closing the control pipe; also happens if L dies)."""
        if self.ctl_w is not None:
            os.close(self.ctl_w)
            self.ctl_w = None

    def wait(self):
        """How G ended (after every process of the run is gone)."""
        if self.report is None:
            data = _read_all(self.report_r)
            os.close(self.report_r)
            os.waitpid(self.pid, 0)
            self.report = json.loads(data) if data else {"setup_error": "sandbox reaper died", "status": None}
            self.stop()
        return self.report


def _read_all(fd, deadline=None):
    """Everything until EOF (or until ``deadline``, monotonic seconds)."""
    chunks = []
    while True:
        if deadline is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return b"".join(chunks)
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _fork_call(fn, keep, on_error):
    """Fork a child that keeps only the fds in ``keep``, runs ``fn()`` and writes its result
    (or ``on_error(exc)``) as JSON to a pipe; returns (pid, the pipe's read end)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_end)
            _close_all_but([*keep, write_end])
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - reported, never raised past the fork
            result, code = on_error(exc), 1
        try:
            os.write(write_end, json.dumps(result).encode()[: 1 << 16])
        finally:
            os._exit(code)
    os.close(write_end)
    return pid, read_end


def start_candidate(spec, argv, fds):
    """Fork C, which starts G with ``fds`` ({target fd: L's fd}) and ``argv``."""
    ctl_r, ctl_w = os.pipe()
    pid, report_r = _fork_call(lambda: _reap(spec, argv, fds, ctl_r), [ctl_r, *fds.values()],
                               lambda exc: {"setup_error": f"{type(exc).__name__}: {exc}", "status": None})
    os.close(ctl_r)
    for fd in fds.values():
        os.close(fd)
    return Candidate(pid, ctl_w, report_r)


def _reap(spec, argv, fds, ctl_r):
    layers = spec["layers"]
    if layers.get("userns"):
        enter_userns(spec["host_uid"], spec["host_gid"])
    if layers["pid"]:
        unshare(CLONE_NEWPID)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    start = time.monotonic()
    g = os.fork()
    if g == 0:
        err = [err_w]  # where set-up errors go (moved out of the way of fds 0..4 on the way)
        try:
            os.close(err_r)
            os.close(ctl_r)
            _become_candidate(spec, argv, fds, err)
        except BaseException as exc:  # noqa: BLE001
            with contextlib.suppress(OSError):
                os.write(err[0], f"{type(exc).__name__}: {exc}".encode()[:2000])
        finally:
            os._exit(SETUP_FAILED)  # never return into the reaper's code
    os.close(err_w)
    for fd in fds.values():
        os.close(fd)
    deadline = start + spec["limits"]["timeout"]
    setup_error = _read_all(err_r, deadline).decode(errors="replace")  # EOF at exec, or why it failed
    os.close(err_r)
    execed = time.monotonic()
    timed_out = _wait_or_kill(spec, g, ctl_r, deadline)
    ended = time.monotonic()
    _, status = os.waitpid(g, 0)
    _sweep(spec, g)
    done = time.monotonic()
    return {"status": os.waitstatus_to_exitcode(status), "timed_out": timed_out, "wall_s": done - start,
            "setup_error": setup_error or None,
            "phases": {"setup": execed - start, "run": ended - execed, "reap": done - ended}}


def _wait_or_kill(spec, g, ctl_r, deadline):
    """Wait for G to exit, L to ask for a stop (or die), or the deadline; True on the deadline."""
    pidfd = os.pidfd_open(g)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(ctl_r, select.POLLIN)
    timed_out = False
    # Without a cgroup (a user's sandbox), the run's memory as a whole is watched: the
    # resident memory of every process of its PID namespace, sampled through its own /proc.
    layers = spec["layers"]
    watch = spec.get("mode") == "userns" and layers["pid"] and layers["mount"] and not layers.get("cgroup")
    tick = MEMORY_TICK_S if watch else None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready = {fd for fd, _ in poller.poll(min(left, tick or left) * 1000)}
            if pidfd in ready or ctl_r in ready:
                break
            if watch and run_rss(g) > spec["limits"]["memory_mb"] << 20:
                break
        _kill_g(spec, g)
    finally:
        os.close(pidfd)
    return timed_out


def run_rss(g):
    """Bytes resident in every process of G's PID namespace (its /proc, seen through G's root)."""
    base, total = f"/proc/{g}/root/proc", 0
    try:
        pids = [p for p in os.listdir(base) if p.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"{base}/{pid}/statm", "rb") as fh:
                total += int(fh.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            pass
    return total


def _kill_g(spec, g):
    try:  # G is PID 1 of its namespace: its death kills every other process there
        os.kill(g, signal.SIGKILL) if spec["layers"]["pid"] else os.killpg(g, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _sweep(spec, g):
    """Without a PID namespace, hunt what left the process group (the cgroup, then the uid)."""
    if spec["layers"]["pid"]:
        return
    _kill_g(spec, g)
    for procs in (spec["cgroup"] or []) if spec["layers"]["cgroup"] else []:
        kill_procs_of(procs)
    if spec["uid"] is not None:
        kill_uid(spec["uid"])


# ------------------------------------------------------------------ L: the run leader


class _Lines:
    """Line-by-line, bounded, deadline-aware reads from a pipe; writes to another."""

    def __init__(self, read_fd, write_fd, deadline, limit):
        self.read_fd, self.write_fd, self.deadline, self.limit = read_fd, write_fd, deadline, limit
        self.buf = b""

    def write(self, text):
        try:
            os.write(self.write_fd, text.encode() + b"\n")
            return True
        except OSError:  # the candidate is gone
            return False

    def read(self):
        """The next line (without newline); None at EOF or the deadline; raises on overflow."""
        while b"\n" not in self.buf:
            if len(self.buf) > self.limit:
                raise ValueError(f"answer longer than {self.limit} bytes")
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                return None
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8", errors="replace")


def _output(fd, limit):
    data = os.pread(fd, limit + 1, 0)
    os.close(fd)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _workdir(spec):
    """Without a mount namespace the program runs in a host directory of its own."""
    if spec["layers"]["mount"]:
        return None
    import tempfile

    path = tempfile.mkdtemp(prefix="realscale-sbx-", dir=spec["fs"]["scratch"])
    with open(os.path.join(path, "program.py"), "w", encoding="utf-8") as fh:
        fh.write(spec["program"])
    if spec["uid"] is not None:
        for p in (path, os.path.join(path, "program.py")):
            os.chown(p, spec["uid"], spec["uid"])
    return path


def _run_process(spec, argv, stdin):
    """One candidate process to its end; its report with stdout/stderr."""
    out, err = _memfd(), _memfd()
    cand = start_candidate(spec, argv, {0: _memfd(stdin.encode()), 1: os.dup(out), 2: os.dup(err)})
    report = cand.wait()
    lim = spec["limits"]
    report["stdout"], report["stdout_truncated"] = _output(out, lim["max_output"])
    report["stderr"], _ = _output(err, lim["max_stderr"])
    return report


def _run_programs(conn, spec):
    """plain / stdio forms: one process per input; P judges each output and says go on or stop."""
    inputs = spec.get("inputs") or [""]
    argv = [spec["python"], "-I", "-B", "program.py"]
    for i, data in enumerate(inputs):
        send_msg(conn, {"case": i, **_run_process(spec, argv, data)})
        reply = recv_msg(conn)
        if not reply or not reply.get("next"):
            break
    send_msg(conn, {"done": True})


def _start_server(spec, harness):
    """The candidate as a call server (``_harness.py``); returns it, its pipes and output fds."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    out, err = _memfd(), _memfd()
    argv = [spec["python"], "-I", "-S", "-B", "-c", harness]  # -S: nothing to add, and it starts faster
    cand = start_candidate(spec, argv, {0: _memfd(), 1: os.dup(out), 2: os.dup(err), 3: req_r, 4: resp_w})
    limit = spec["limits"]["max_answer"]
    chan = _Lines(resp_r, req_w, time.monotonic() + spec["limits"]["timeout"] + 1.0, limit)
    return cand, chan, (out, err)


def _finish_server(conn, spec, cand, chan, outputs, message):
    os.close(chan.write_fd)  # EOF: the harness returns
    cand.stop()
    message["report"] = cand.wait()
    os.close(chan.read_fd)
    message["stderr"], _ = _output(outputs[1], spec["limits"]["max_stderr"])
    os.close(outputs[0])
    send_msg(conn, {"done": True, **message})


def _first_line(chan):
    try:
        line = chan.read()
        return json.loads(line) if line else {"load_error": "the program ended or ran out of time before loading"}
    except ValueError as exc:
        return {"load_error": f"bad first line: {exc}"}


def _run_calls(conn, spec, harness):
    """calls form: L sends each call's arguments; P decodes and judges each raw answer."""
    cand, chan, outputs = _start_server(spec, harness)
    first = _first_line(chan)
    if first.get("ready"):
        for i, (args, kwargs) in enumerate(spec["calls"]):
            try:
                ok = chan.write(json.dumps({"fn": spec["fn"], "args": args, "kwargs": kwargs}))
                line = chan.read() if ok else None
            except ValueError as exc:
                line = json.dumps({"raise": "AnswerTooLong", "msg": str(exc)})
            send_msg(conn, {"call": i, "response": line})
            reply = recv_msg(conn)
            if line is None or not reply or not reply.get("next"):
                break
    _finish_server(conn, spec, cand, chan, outputs, {"load": first})


def _run_check(conn, spec, harness, plain):
    """check form: J runs the test code against the candidate; L relays J's verdict."""
    cand, chan, outputs = _start_server(spec, harness)
    judge, verdict_r = _fork_call(lambda: _judge(spec, chan, plain), [chan.read_fd, chan.write_fd],
                                  lambda exc: {"passed": False, "detail": f"judge failed: {type(exc).__name__}: {exc}"})
    deadline = time.monotonic() + spec["limits"]["timeout"] + 2.0
    verdict = None
    if select.select([verdict_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
        data = _read_all(verdict_r)
        verdict = json.loads(data) if data else None
    os.close(verdict_r)
    try:
        os.kill(judge, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(judge, 0)
    verdict = verdict or {"passed": False, "detail": "the judge ran out of time"}
    _finish_server(conn, spec, cand, chan, outputs, {"verdict": verdict})


# ------------------------------------------------------------------ J: the judge


class CandidateGone(BaseException):
    """The candidate process ended, ran out of time or answered garbage (not an Exception,
    so that a test's ``except Exception`` cannot swallow it)."""


def _judge(spec, chan, plain):
    """Run the test code with each name it takes from the candidate bound to a call proxy."""
    if spec["layers"].get("userns"):
        enter_userns(spec["host_uid"], spec["host_gid"])
    if spec["layers"]["net"]:
        unshare(CLONE_NEWNET)
    if spec["layers"].get("userns"):
        drop_caps()
    resource.setrlimit(resource.RLIMIT_CPU, (int(spec["limits"]["timeout"]) + 2,) * 2)
    _preimport(spec["prelude"], spec["test"])
    modules = _modules_named(spec["names"])  # e.g. MBPP's ``math.isclose`` without an import
    _drop(spec["judge_uid"])
    os.chdir("/")
    first = _first_line(chan)
    if not first.get("ready"):
        return {"passed": False, "detail": f"program did not load: {first.get('load_error', first)}"[:500]}
    ns = {"__name__": "__judge__"}
    if spec["prelude"]:
        try:  # the prompt's imports and helpers; a prompt that is not runnable code gives what it defined
            exec(compile(spec["prelude"], "<prelude>", "exec"), ns)
        except Exception:  # noqa: BLE001
            pass
    for name in spec["names"]:
        if name == spec["entry_point"] or name not in ns:
            ns[name] = modules[name] if name in modules and name != spec["entry_point"] else _proxy(name, chan, plain)
    try:
        exec(compile(spec["test"], "<test>", "exec"), ns)
        if spec["entry_point"] and callable(ns.get("check")):
            ns["check"](_proxy(spec["entry_point"], chan, plain))
    except CandidateGone as exc:
        return {"passed": False, "detail": f"failed: {exc}"}
    except BaseException as exc:  # noqa: BLE001 - any failure of the test code is a failed test
        return {"passed": False, "detail": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}
    return {"passed": True, "detail": "passed"}


_COMMON_TEST_IMPORTS = ("import ast, bisect, collections, copy, decimal, fractions, functools, hashlib, heapq, "
                        "itertools, json, math, random, re, statistics, string, typing")


def _preimport(*sources):
    """Import the modules the test code names while still able to read the interpreter's
    files (they may sit in a directory the judge uid cannot enter, such as /root)."""
    import ast
    import importlib

    for source in sources:
        for node in ast.walk(ast.parse(source or "")):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                try:
                    importlib.import_module(name)
                except BaseException:  # noqa: BLE001 - the test itself will report it
                    pass


def _modules_named(names):
    """The test's free names that are standard modules (imported here, not asked of the program)."""
    import importlib

    found = {}
    for name in names:
        if name in sys.stdlib_module_names:
            try:
                found[name] = importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - then it is the program's name after all
                pass
    return found


def _proxy(name, chan, plain):
    def call(*args, **kwargs):
        try:
            request = {"fn": name, "args": plain.to_json(list(args)), "kwargs": plain.to_json(kwargs)}
        except plain.PlainError as exc:
            raise CandidateGone(f"the test passes {name}() an argument that is not plain data ({exc})") from None
        try:
            line = chan.read() if chan.write(json.dumps(request)) else None
            answer = json.loads(line) if line is not None else None
            if not isinstance(answer, dict):
                raise CandidateGone(f"{name}(): the program ended or ran out of time")
            if "ok" in answer:
                return plain.from_json(answer["ok"])
        except (ValueError, RecursionError) as exc:  # PlainError is a ValueError
            raise CandidateGone(f"{name}(): malformed answer ({str(exc)[:100]})") from None
        raise _exception(answer)

    call.__name__ = name
    return call


def _exception(answer):
    """The candidate's exception as a builtin Exception type (never BaseException) with its message."""
    import builtins

    kind = getattr(builtins, str(answer.get("raise")), None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = RuntimeError
    try:
        return kind(str(answer.get("msg", ""))[:500])
    except Exception:  # noqa: BLE001 - exception types with other signatures
        return RuntimeError(str(answer.get("msg", ""))[:500])


# ------------------------------------------------------------------ Z: the zygote


def run_one(conn, harness, plain):
    """L: one run, start to end, over ``conn``."""
    os.setsid()  # a session per run: its processes together, and (with autogroup) its own CPU share
    spec = recv_msg(conn)
    if spec is None:
        return
    send_msg(conn, {"pid": os.getpid()})
    workdir = None
    try:
        workdir = _workdir(spec)
        spec["workdir"] = workdir
        form = spec["form"]
        if form in ("plain", "stdio"):
            _run_programs(conn, spec)
        elif form == "calls":
            _run_calls(conn, spec, harness)
        elif form == "check":
            _run_check(conn, spec, harness, plain)
        else:
            send_msg(conn, {"done": True, "error": f"unknown form {form!r}"})
    except (BrokenPipeError, ConnectionError):
        pass  # P went away; closing our ends makes every C kill its G
    finally:
        if workdir:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


def serve(ctl):
    """Z: fork one L per request (a message carrying the run's socket) until P closes ``ctl``."""
    plain, plain_src = _load_sibling("plain.py")
    _, harness_src = _load_sibling("_harness.py")
    harness = plain_src + "\n" + harness_src
    _preimport(_COMMON_TEST_IMPORTS)  # once here: every judge is forked with them loaded
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # L processes are reaped by the kernel
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctl, 16, 4)
        except (ConnectionError, OSError):
            return
        if not msg:
            return
        pid = os.fork()
        if pid == 0:
            try:
                ctl.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                run_one(socket.socket(fileno=fds[0]), harness, plain)
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        raise SystemExit("usage: _sandbox_exec.py serve  (started by realscale.reward.sandbox)")
    serve(socket.socket(fileno=int(sys.argv[2])))

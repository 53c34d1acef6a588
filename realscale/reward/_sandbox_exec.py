"""Sandbox launcher: isolate this process, drop privileges, then exec the untrusted program.

Run as ``python -I -S _sandbox_exec.py '<json spec>'`` by :mod:`realscale.reward.sandbox`
in a fresh session (its own process group). It uses only the standard library, and no
``preexec_fn``: forking a threaded parent and running Python between fork and exec can
deadlock, so all the set-up happens here, in a clean process, before ``execve``.

Steps, each only when the spec asks (the parent probed what this machine permits):
1. chdir into the work dir (the cwd keeps it reachable after /tmp is covered below);
2. ``unshare(CLONE_NEWNET)``: a network namespace with only a down loopback, so no socket
   can reach anything; ``unshare(CLONE_NEWNS)``: a private mount table in which /tmp,
   /var/tmp and /dev/shm become small empty tmpfs, so files written there vanish;
3. resource limits (CPU seconds, address space, file size, processes, open files, no core);
4. setgroups([]) / setgid / setuid to an unprivileged id of its own;
5. execve the program with the scrubbed environment.
Exit code 126 with a message on stderr means a set-up step failed (nothing ran).
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18


def _libc_call(libc, name, *args):
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args!r}: {os.strerror(err)}")


def isolate(spec):
    libc = ctypes.CDLL(None, use_errno=True)
    flags = (CLONE_NEWNET if spec["net"] else 0) | (CLONE_NEWNS if spec["mount"] else 0)
    if flags:
        _libc_call(libc, "unshare", flags)
    if spec["mount"]:
        _libc_call(libc, "mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
        for target in (b"/tmp", b"/var/tmp", b"/dev/shm"):
            if os.path.isdir(target):
                _libc_call(libc, "mount", b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV,
                           b"size=%dm,mode=1777" % spec["tmpfs_mb"])
        if spec["cover"]:
            _expose_python(libc, spec["cover"], spec["expose"])


def _expose_python(libc, cover, expose):
    """Hide ``cover`` (e.g. /root, closed to other users) behind an empty tmpfs and bind the
    Python install inside it back at its own path, so the dropped uid can run Python while
    the rest of that directory (ssh keys, tokens) stays out of sight."""
    fd = os.open(expose, os.O_PATH | os.O_DIRECTORY)
    _libc_call(libc, "mount", b"tmpfs", cover.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755")
    os.makedirs(expose, mode=0o755, exist_ok=True)
    _libc_call(libc, "mount", b"/proc/self/fd/%d" % fd, expose.encode(), None, MS_BIND | MS_REC, None)
    os.close(fd)


def limit(spec):
    mb = 1024 * 1024
    for res, value in ((resource.RLIMIT_CPU, spec["cpu_s"]), (resource.RLIMIT_AS, spec["memory_mb"] * mb),
                       (resource.RLIMIT_FSIZE, spec["file_mb"] * mb), (resource.RLIMIT_NOFILE, spec["files"]),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    if spec["nproc"] > 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))


def main():
    spec = json.loads(sys.argv[1])
    try:
        os.chdir(spec["workdir"])
        isolate(spec)
        limit(spec)
        if spec["uid"] is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
    except Exception as exc:  # noqa: BLE001 - any failure: refuse to run the program
        sys.stderr.write(f"sandbox set-up failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(126)
    # "-c" rather than a script path: Python would turn the path into an absolute one that
    # the private /tmp now hides, while the cwd still reaches the work dir.
    run = ("import sys; sys.argv = ['program.py']; "
           "exec(compile(open('program.py', 'rb').read(), 'program.py', 'exec'))")
    os.execve(spec["python"], [spec["python"], "-I", "-B", "-c", run], spec["env"])


if __name__ == "__main__":
    main()

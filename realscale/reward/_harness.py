"""The call server that runs inside the sandbox, in the candidate's own interpreter.

Its source is ``plain.py`` followed by this file, run as ``python -I -B -c <source>`` by
``_sandbox_exec.py``. It loads ``program.py`` (the candidate) into a fresh namespace, says
``ready`` (or why loading failed), then answers one request per line on fd 3 with one line on
fd 4: ``{"fn": name, "args": [...], "kwargs": {...}}`` (plain-data trees) in, ``{"ok": value}``
or ``{"raise": "ValueError", "msg": "..."}`` out.

Nothing here is trusted: the candidate shares this process and may rewrite any of it. That
is harmless by construction: the judge outside reads only lines of plain data and compares
them itself, so tampering can only produce a wrong, missing or malformed answer.
"""

import os as _os
import sys as _sys


def _reply(out, message):
    out.write((json.dumps(message, separators=(",", ":")) + "\n").encode())
    out.flush()


def _error(exc):
    return {"raise": type(exc).__name__, "msg": str(exc)[:500]}


def _target(ns, name):
    fn = ns.get(name)
    if callable(fn):
        return fn
    solution = ns.get("Solution")  # LeetCode / LiveCodeBench style: a method of class Solution
    if isinstance(solution, type) and callable(getattr(solution, name, None)):
        return getattr(solution(), name)
    raise NameError(f"program defines no function {name!r}")


def _serve():
    requests, out = _os.fdopen(3, "rb"), _os.fdopen(4, "wb")
    ns = {"__name__": "__main__", "__file__": "program.py", "__builtins__": __builtins__}
    try:
        with open("program.py", "rb") as fh:
            exec(compile(fh.read(), "program.py", "exec"), ns)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: the load failed
        _reply(out, {"load_error": f"{type(exc).__name__}: {str(exc)[:500]}"})
        return
    _reply(out, {"ready": True})
    for line in requests:
        try:
            req = json.loads(line)
            args, kwargs = from_json(req["args"]), from_json(req["kwargs"])
            value = _target(ns, req["fn"])(*args, **kwargs)
            message = {"ok": to_json(value)}
        except BaseException as exc:  # noqa: BLE001 - reported to the judge as a failed call
            message = _error(exc)
        _reply(out, message)


if __name__ == "__main__":
    _serve()
    _sys.stdout.flush()
    _os._exit(0)

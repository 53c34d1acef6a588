"""realscale._pyast.parse survives threads that parse at once, where the bare ``ast.parse``
of CPython 3.11 fails (the reward battery hit it in CI: "AST constructor recursion depth
mismatch")."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Four threads at different stack depths parse while garbage with finalizers forces the GIL
# to change hands inside the C conversion of the tree; prints how many parses raised
# SystemError.
STRESS = r"""
import ast, gc, sys, threading, time
from realscale._pyast import parse
PARSE = {"ours": parse, "bare": ast.parse}[sys.argv[1]]
sys.setswitchinterval(1e-6)
gc.set_threshold(50, 1, 1)
SRC = "def f(a):\n    return [x for x in a if x]\n" * 100
class Cycle:
    def __init__(self): self.me = self
    def __del__(self): time.sleep(0)
errors = []
def deep(n, fn):
    return deep(n - 1, fn) if n else fn()
def work(depth):
    def loop():
        for _ in range(200):
            Cycle()
            try:
                PARSE(SRC)
            except SystemError as exc:
                errors.append(str(exc))
                return
    deep(depth, loop)
threads = [threading.Thread(target=work, args=(d,)) for d in (0, 5, 10, 20)]
for t in threads: t.start()
for t in threads: t.join()
print(len(errors))
"""


def _stress(which: str) -> int:
    out = subprocess.run([sys.executable, "-c", STRESS, which], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip())


def test_parse_under_thread_contention_never_raises() -> None:
    assert _stress("ours") == 0


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the shared AST recursion counter is a CPython 3.11 bug")
def test_the_stress_reproduces_the_bug_with_bare_ast_parse() -> None:
    """The control: without the lock the same stress fails, so the test above can fail.
    A race is a draw: it reproduced in 10 of 10 runs here (in 1-3 s), so up to three runs
    may be taken before calling the control broken."""
    assert any(_stress("bare") > 0 for _ in range(3))

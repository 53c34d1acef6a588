"""``ast.parse`` made safe to call from several threads at once.

CPython 3.11 keeps the AST constructor's recursion counter in the ``_ast`` module's state,
which every thread shares. When the GIL passes to another thread in the middle of turning
the parse tree into Python objects (a garbage-collection pass can run finalizers there) and
that thread parses too, the first one finds the counter moved and raises ``SystemError: AST
constructor recursion depth mismatch`` (python/cpython#106905 and its reports). The reward
battery scores code samples on threads and hit it. One lock around the parse costs nothing
measurable (a parse takes microseconds to a millisecond) and makes the result independent
of the interpreter's patch level.
"""

from __future__ import annotations

import ast
import threading
from typing import Literal

_LOCK = threading.Lock()


def parse(source: str, mode: Literal["exec", "eval"] = "exec") -> ast.Module | ast.Expression:
    """``ast.parse(source, mode=mode)`` under the process-wide parse lock."""
    with _LOCK:
        return ast.parse(source, mode=mode)

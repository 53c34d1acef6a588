"""Plain data across the sandbox boundary: values in, values out, nothing that runs code.

A candidate's return value reaches the judge only as text, and the judge rebuilds it from
that text with the builtin types alone, so no object of the candidate's (an ``__eq__`` that
always answers True, a ``str`` subclass, a lazy iterator) ever reaches the comparison.
The text is JSON with a few tagged forms for what JSON lacks:

    None, bool, int, str, finite float, list   ->  themselves
    float inf / -inf / nan                     ->  {"$f": "inf"}
    tuple, set, frozenset                      ->  {"$t": [...]}, {"$s": [...]}, {"$fs": [...]}
    dict (any hashable keys)                   ->  {"$d": [[key, value], ...]}
    bytes, complex                             ->  {"$b": "<base64>"}, {"$c": [re, im]}

Only those exact types are encoded (``type(x) is int``, not subclasses); anything else is a
:class:`PlainError`. Decoding accepts only this shape: any other object, or nesting deeper
than :data:`MAX_DEPTH`, is a :class:`PlainError`.

This file uses the standard library only and no ``from __future__`` import: its source is
also the first half of the harness that runs inside the sandbox (see ``_harness.py``).
"""

import base64
import json
import math

MAX_DEPTH = 64
_TAGS = ("$f", "$t", "$s", "$fs", "$d", "$b", "$c")


class PlainError(ValueError):
    """A value (or a text) that is not plain data."""


def to_json(value, depth=0):
    """``value`` as a JSON-ready tree (see the module docstring)."""
    if depth > MAX_DEPTH:
        raise PlainError(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$f": repr(value)}
    if kind is list:
        return [to_json(v, depth + 1) for v in value]
    if kind in (tuple, set, frozenset):
        tag = {tuple: "$t", set: "$s", frozenset: "$fs"}[kind]
        return {tag: [to_json(v, depth + 1) for v in value]}
    if kind is dict:
        return {"$d": [[to_json(k, depth + 1), to_json(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"$b": base64.b64encode(value).decode("ascii")}
    if kind is complex:
        return {"$c": [to_json(value.real, depth + 1), to_json(value.imag, depth + 1)]}
    raise PlainError(f"{kind.__name__} is not plain data")


def from_json(tree, depth=0):
    """Rebuild a value from :func:`to_json`'s tree, with builtin types only."""
    if depth > MAX_DEPTH:
        raise PlainError(f"nested deeper than {MAX_DEPTH}")
    kind = type(tree)
    if tree is None or kind in (bool, int, str, float):
        return tree
    if kind is list:
        return [from_json(v, depth + 1) for v in tree]
    if kind is not dict or len(tree) != 1:
        raise PlainError(f"unexpected {kind.__name__} in plain data")
    (tag, body), = tree.items()
    try:
        return _untag(tag, body, depth)
    except (TypeError, ValueError, OverflowError) as exc:  # unhashable key, bad base64, bad float
        if isinstance(exc, PlainError):
            raise
        raise PlainError(f"bad {tag!r} value: {exc}") from None


def _untag(tag, body, depth):
    if tag == "$f" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag == "$b" and type(body) is str:
        return base64.b64decode(body.encode("ascii"), validate=True)
    if type(body) is not list:
        raise PlainError(f"tag {tag!r} needs a list")
    items = [from_json(v, depth + 1) for v in body]
    if tag == "$t":
        return tuple(items)
    if tag == "$s":
        return set(items)
    if tag == "$fs":
        return frozenset(items)
    if tag == "$d" and all(type(p) is list and len(p) == 2 for p in items):
        return {k: v for k, v in items}
    if tag == "$c" and len(items) == 2 and all(type(x) in (int, float) for x in items):
        return complex(items[0], items[1])
    raise PlainError(f"bad tagged value {tag!r}")


def encode(value):
    """``value`` as one line of text (no newline inside)."""
    return json.dumps(to_json(value), allow_nan=False, separators=(",", ":"))


def decode(text, limit=1 << 24):
    """The value :func:`encode` wrote, or :class:`PlainError`."""
    if len(text) > limit:
        raise PlainError(f"{len(text)} chars > {limit}")
    try:
        tree = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise PlainError(f"not JSON: {str(exc)[:100]}") from None
    return from_json(tree)

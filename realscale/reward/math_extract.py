"""Find the final answer in a model's completion.

Rules, first that applies wins: the last ``\\boxed{...}`` (or ``\\fbox``; braces nest,
escaped ``\\{ \\}`` do not count), the last "the (final) answer is ...", the last GSM8K
``#### ...`` line, and last the final number in the text. Every scan is linear in the text
length (no backtracking regexes), so a hostile completion cannot stall the caller.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(r"(?i)\b(?:final answer|the answer)\s*(?:is|:|=)\s*:?")
_GSM_MARK = re.compile(r"####[ \t]*([^\n]*)")
# A number as people write it: optional sign, digits with optional thousands commas,
# optional decimals, optional "/denominator" and percent. The last one is the fallback answer.
_NUMBER = re.compile(r"[-−]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?(?:\\?%)?")
_INLINE_MATH = re.compile(r"\$\$?([^$]+)\$\$?|\\\((.+?)\\\)|\\\[(.+?)\\\]")


def matching_brace(text: str, open_at: int, stop: int | None = None) -> int:
    """Index of the ``}`` closing the ``{`` at ``open_at`` (searching before ``stop``), or -1."""
    depth = 0
    i = open_at
    n = len(text) if stop is None else stop
    while i < n:
        ch = text[i]
        if ch == "\\":  # an escaped character (\{, \}, \\) is never structure
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _box_content(text: str, start: int, command: str, stop: int) -> str | None:
    """The argument of the box command at ``start``: ``{...}`` closing before ``stop``, or a bare token."""
    i = start + len(command)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] == "{":
        end = matching_brace(text, i, stop)
        return text[i + 1 : end] if end != -1 else None
    if start + len(command) == i:  # "\boxedx" is another command, not a box
        return None
    token = re.match(r"[^\s$]+", text[i:])  # "\boxed 5": the argument is one token
    return token.group(0) if token else None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{}``/``\\fbox{}`` in ``text``, else None."""
    # Walk the boxes from the last to the first. When a box never closes, an earlier box
    # can only close before that one starts (else it would contain the unclosed brace), so
    # each scan stops there; with each command's last position remembered, the walk is linear.
    stop = len(text)
    found = {c: text.rfind(c) for c in _BOX_COMMANDS}
    while True:
        pos, command = max((p, c) for c, p in found.items())
        if pos == -1:
            return None
        content = _box_content(text, pos, command, stop)
        if content is not None:
            return content.strip()
        stop = pos
        found[command] = text.rfind(command, 0, pos)


def _first_math_or_sentence(tail: str) -> str:
    """The answer written after "the answer is": its inline math, else up to the sentence end."""
    # Only the head of the line: the answer is short, and this bounds the inline-math scan.
    line = tail.strip().split("\n", 1)[0][:1000]
    boxed = last_boxed(line)
    if boxed is not None:
        return boxed
    math = _INLINE_MATH.search(line)
    if math is not None:
        return next(g for g in math.groups() if g is not None).strip()
    # A sentence ends at ". " or a final "."; a decimal point is followed by a digit.
    end = re.search(r"\.(?:\s|$)", line)
    return (line[: end.start()] if end else line).strip().rstrip(".").strip()


def answer_is(text: str) -> str | None:
    """What follows the last "the answer is" / "final answer:", else None."""
    last = None
    for last in _ANSWER_IS.finditer(text):
        pass
    if last is None:
        return None
    found = _first_math_or_sentence(text[last.end() :])
    return found or None


def gsm_answer(text: str) -> str | None:
    """The text after the last GSM8K ``####`` marker, else None."""
    last = None
    for last in _GSM_MARK.finditer(text):
        pass
    if last is None:
        return None
    return last.group(1).strip().rstrip(".").strip() or None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (with its sign, decimals, fraction, percent)."""
    last = None
    for last in _NUMBER.finditer(text):
        pass
    if last is None:
        return None
    return last.group(0).rstrip(",").strip() or None


def extract_answer(completion: str) -> tuple[str, str] | None:
    """``(answer, rule)`` for a completion, rule one of boxed/answer_is/gsm/last_number; None if no answer."""
    for rule, finder in (("boxed", last_boxed), ("answer_is", answer_is), ("gsm", gsm_answer),
                         ("last_number", last_number)):
        found = finder(completion)
        if found:
            return found, rule
    return None


def reference_answer(reference: str) -> str:
    """The answer inside a reference: its boxed content or text after ``####``, else the whole string."""
    ref = reference.strip()
    boxed = last_boxed(ref)
    if boxed is not None:
        return boxed
    gsm = gsm_answer(ref)
    if gsm is not None:
        return gsm
    return ref

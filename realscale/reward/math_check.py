"""One math check, as a reward worker runs it: extract, fast path, then math-verify.

Runs inside a :class:`~realscale.reward.pool.WatchdogPool` child. Each check is bounded
twice: a ``SIGALRM`` interval timer raises :class:`CheckTimeout` inside Python code (the
worker then carries on), and the pool kills the worker if a check is stuck in C code
where signals cannot reach it. math-verify's own signal timeouts are switched off because
they turn a timeout into a silent "not equal", and we want the reason in the stats.
"""

from __future__ import annotations

import logging
import signal
from functools import lru_cache
from typing import Any

from realscale.reward.math_extract import extract_answer, matching_brace, reference_answer
from realscale.reward.math_fast import fast_check
from realscale.reward.result import ERROR, NO_ANSWER, OK, TIMEOUT, TOO_LONG

# (value, reason, detail): plain tuples pickle faster than dataclasses across the pipe.
Outcome = tuple[float, str, str]

_settings = {"timeout": 5.0, "max_chars": 2000, "fast_path": True}


class CheckTimeout(BaseException):
    """Raised by the interval timer. A BaseException, so math-verify's ``except Exception`` lets it through."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise CheckTimeout()


def init_worker(timeout: float, max_chars: int, fast_path: bool = True) -> None:
    """Pool initializer: settings, the alarm handler, and math-verify imported up front."""
    _settings.update(timeout=timeout, max_chars=max_chars, fast_path=fast_path)
    signal.signal(signal.SIGALRM, _on_alarm)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" warnings: we time out ourselves
    import math_verify  # noqa: F401 - pay the sympy import once, not on the first symbolic check


def _as_latex(answer: str) -> str:
    """Wrap an extracted answer so math-verify's LaTeX extractor takes all of it."""
    if "$" not in answer and _balanced(answer):
        return "\\boxed{" + answer + "}"
    return answer if "$" in answer else "$" + answer + "$"


def _balanced(text: str) -> bool:
    return matching_brace("{" + text + "}", 0) == len(text) + 1


@lru_cache(maxsize=8192)
def _mv_parse(latex: str) -> tuple[Any, ...]:
    """math-verify's parse, cached: RL groups score many samples against one reference."""
    from math_verify import parse

    return tuple(parse(latex, parsing_timeout=None))  # type: ignore[arg-type]


def _mv_equal(gold: str, pred: str) -> tuple[bool, str]:
    from math_verify import verify

    gold_parsed = _mv_parse(_as_latex(gold))
    if not gold_parsed:
        raise ValueError(f"reference {gold[:80]!r} could not be parsed")
    pred_parsed = _mv_parse(_as_latex(pred))
    if not pred_parsed:
        return False, "answer not parsable"
    return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None)), "math-verify"


def _check(completion: str, reference: str) -> Outcome:
    outcome, gold, pred, rule = _without_sympy(completion, reference, _settings["max_chars"], _settings["fast_path"])
    if outcome is not None:
        return outcome
    equal, how = _mv_equal(gold, pred)
    return float(equal), OK, f"{rule}/{how}"


def _without_sympy(completion: str, reference: str, max_chars: int, fast_path: bool
                   ) -> tuple[Outcome | None, str, str, str]:
    """Everything of a check before math-verify: the outcome if that settles it (no
    answer, too long, or the fast path's verdict), else ``None`` with the extracted
    reference answer, answer and extraction rule for math-verify."""
    gold = reference_answer(reference)
    if len(gold) > max_chars:
        return (0.0, TOO_LONG, f"reference answer has {len(gold)} chars > {max_chars}"), gold, "", ""
    found = extract_answer(completion)
    if found is None:
        return (0.0, NO_ANSWER, ""), gold, "", ""
    pred, rule = found
    if len(pred) > max_chars:
        return (0.0, TOO_LONG, f"answer has {len(pred)} chars > {max_chars}"), gold, pred, rule
    if fast_path:
        verdict = fast_check(gold, pred)
        if verdict is not None:
            return (float(verdict), OK, f"{rule}/fast"), gold, pred, rule
    return None, gold, pred, rule


def settle_without_sympy(completion: str, reference: str, max_chars: int) -> Outcome | None:
    """The check's outcome when it needs no math-verify (plain numbers, no answer, too
    long), computed in the caller's process; ``None`` when math-verify must decide, or
    when anything raised (the worker then runs it and reports the error). Only for short
    inputs: extraction and the fast path are a few regexes over the text with no timer,
    so the caller bounds the text (:data:`realscale.reward.math_reward.IN_PROCESS_CHARS`)."""
    try:
        return _without_sympy(completion, reference, max_chars, True)[0]
    except Exception:  # noqa: BLE001 - the worker reruns it under its timer and names the error
        return None


def check(item: tuple[str, str]) -> Outcome:
    """Score ``(completion, reference)``; never raises, always returns within the timer."""
    try:
        return _timed_check(*item)
    except CheckTimeout:  # the timer fired in the instant between the verdict and its reset
        signal.setitimer(signal.ITIMER_REAL, 0)
        return 0.0, TIMEOUT, f"check took over {_settings['timeout']} s"


def _timed_check(completion: str, reference: str) -> Outcome:
    signal.setitimer(signal.ITIMER_REAL, _settings["timeout"])
    try:
        return _check(completion, reference)
    except CheckTimeout:
        return 0.0, TIMEOUT, f"check took over {_settings['timeout']} s"
    except Exception as exc:  # noqa: BLE001 - a bad input scores 0 with its reason, never kills the worker
        return 0.0, ERROR, f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)

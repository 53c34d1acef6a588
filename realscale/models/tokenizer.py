"""Loading a model directory's tokenizer: ``AutoTokenizer.from_pretrained``, without paying
for ``AutoTokenizer`` again and again.

Importing transformers' ``AutoTokenizer`` module costs ~2.7 s of CPU (it pulls in
``torch._dynamo`` and DTensor through transformers' configuration and masking modules),
and a run pays it in every process that loads a tokenizer: the supervisor's evaluation,
each generation server, each rollout process — on a 2-core machine, seconds of start-up
(BENCHMARKS.md, "Start-up and checkpoints inside the loop"). Loading by the tokenizer's own
class costs ~0.9 s. Which class ``AutoTokenizer`` picks for a directory depends on tables
only its module holds (for a Qwen2 directory it picks ``Qwen2Tokenizer`` over the
``TokenizersBackend`` the directory names), so the choice is not re-derived here: the
first load of a directory goes through ``AutoTokenizer`` and records the class it chose;
later loads, in any process, call that class's ``from_pretrained`` (which is what
``AutoTokenizer`` calls). The record is keyed by the directory's real path, the size and
modification time of its config files and the transformers version, so an edited or
replaced tokenizer or an upgrade goes through ``AutoTokenizer`` again; it lives in
``$REALSCALE_CACHE/tokenizer_classes.json`` (default ``~/.cache/realscale``). A cache that
cannot be read or written changes nothing but the time.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from importlib.metadata import version
from typing import Any

from realscale.models.cache import cache_base

# what AutoTokenizer's choice depends on, besides transformers' own tables
_KEY_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json", "special_tokens_map.json")


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)``: the same class, loaded the same way."""
    key = _choice_key(path)
    choice = _choices().get(key) if key else None
    if choice:
        module, _, name = choice.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # moved in another transformers: ask AutoTokenizer
            cls = None
        if cls is not None:
            return cls.from_pretrained(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if key:
        _record(key, f"{type(tok).__module__}:{type(tok).__qualname__}")
    return tok


def _choice_key(path: str) -> str | None:
    """The record's key for a local model directory; None (no record) for anything else
    (a hub name, a directory without a ``tokenizer_config.json``, remote code)."""
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        return None
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as fh:
            if "auto_map" in json.load(fh):  # the class is the directory's own code
                return None
    except (OSError, ValueError):
        return None
    stats = []
    for name in _KEY_FILES:
        try:
            st = os.stat(os.path.join(path, name))
            stats.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            stats.append(f"{name}:-")
    return json.dumps([os.path.realpath(path), version("transformers"), stats])


def _cache_file() -> str:
    return os.path.join(cache_base(), "tokenizer_classes.json")


def _choices() -> dict[str, str]:
    try:
        with open(_cache_file(), encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _record(key: str, choice: str) -> None:
    """Add one choice, written whole (a concurrent writer may drop another's new entry:
    that process's next load asks AutoTokenizer again, nothing worse)."""
    path = _cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        choices = _choices()
        choices[key] = choice
        fd, tmp = tempfile.mkstemp(prefix=".tokenizer_classes.", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(choices, fh)
        os.replace(tmp, path)
    except OSError:
        pass

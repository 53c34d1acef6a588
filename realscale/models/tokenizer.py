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

:func:`load_light_tokenizer` goes one step further for the processes that only encode
prompts and decode answers (generation servers, rollout processes, evaluation): each load
through transformers also records a snapshot of the loaded tokenizer
(:func:`realscale.models.light_tokenizer.snapshot_of`, keyed by the contents of the
directory's tokenizer files and the two libraries' versions, so a run's exported checkpoints
share their warm start's; in ``$REALSCALE_CACHE/tokenizer_snapshots``, the
:data:`MAX_SNAPSHOTS` most recently used kept), from which
a later process builds a :class:`~realscale.models.light_tokenizer.LightTokenizer` without
importing transformers at all. Where there is no snapshot (a first load, a tokenizer the
snapshot cannot reproduce) it returns :func:`load_tokenizer`'s tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from realscale.models.cache import cache_base
from realscale.models.light_tokenizer import LightTokenizer, snapshot_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# what AutoTokenizer's choice and the loaded tokenizer depend on, besides transformers' own code
_KEY_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json", "special_tokens_map.json",
              "chat_template.jinja", "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt",
              "tokenizer.model")
MAX_SNAPSHOTS = 16  # tokenizer snapshots kept (~1-10 MB each); the least recently used go first


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
            tok = cls.from_pretrained(path)
            _keep_snapshot(path, tok)
            return tok
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if key:
        _record(key, f"{type(tok).__module__}:{type(tok).__qualname__}")
        _keep_snapshot(path, tok)
    return tok


def load_light_tokenizer(path: str) -> Any:
    """The tokenizer of ``path`` for encoding prompts and decoding answers: a
    :class:`~realscale.models.light_tokenizer.LightTokenizer` (no transformers import) when
    an earlier load recorded a snapshot of it, else :func:`load_tokenizer`'s (which records one)."""
    key = _snapshot_key(path)
    if key:
        file = _snapshot_file(key)
        try:
            with open(file, encoding="utf-8") as fh:
                snap = json.load(fh)
        except FileNotFoundError:
            snap = None
        except (OSError, ValueError) as exc:
            log.warning("tokenizer snapshot %s unreadable (%s); loading %s with transformers", file, exc, path)
            snap = None
        if snap is not None and snap.get("key") == key:
            try:
                tok = LightTokenizer(snap, path)
            except Exception as exc:  # noqa: BLE001 - a snapshot of another tokenizers version, say
                log.warning("tokenizer snapshot %s unusable (%r); loading %s with transformers", file, exc, path)
            else:
                _touch(file)
                return tok
    return load_tokenizer(path)


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
    return json.dumps([os.path.realpath(path), version("transformers"), version("tokenizers"), stats])


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


def _snapshot_key(path: str) -> str | None:
    """A snapshot's key: the versions of transformers and tokenizers and the contents of the
    directory's tokenizer files, so that a run's exported checkpoints (same tokenizer files,
    new directories) share their warm start's snapshot; None where :func:`_choice_key` is."""
    if _choice_key(path) is None:
        return None
    digest = hashlib.sha256(f"{version('transformers')} {version('tokenizers')}".encode())
    for name in _KEY_FILES:
        try:
            with open(os.path.join(path, name), "rb") as fh:
                data = fh.read()
        except OSError:
            data = None
        digest.update(f"\0{name}\0{-1 if data is None else len(data)}\0".encode())
        digest.update(data or b"")
    return digest.hexdigest()[:32]


def _snapshot_file(key: str) -> str:
    return os.path.join(cache_base(), "tokenizer_snapshots", key + ".json")


def _keep_snapshot(path: str, tok: "PreTrainedTokenizerBase") -> None:
    """Record ``tok``'s snapshot (loaded from ``path``) unless there is one (or it has none);
    keep the newest :data:`MAX_SNAPSHOTS`."""
    key = _snapshot_key(path)
    if key is None:
        return
    file = _snapshot_file(key)
    if os.path.exists(file):
        return
    snap = snapshot_of(tok)
    if snap is None:
        return
    folder = os.path.dirname(file)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".snapshot.", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({**snap, "key": key}, fh)
        os.replace(tmp, file)
        kept = sorted((e for e in os.scandir(folder) if e.name.endswith(".json")), key=lambda e: e.stat().st_mtime,
                      reverse=True)
        for old in kept[MAX_SNAPSHOTS:]:
            os.unlink(old.path)
    except OSError:
        pass


def _touch(file: str) -> None:
    try:
        os.utime(file)
    except OSError:
        pass

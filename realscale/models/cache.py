"""Where built models are cached, and how a cached directory is built without ever being
seen half-written."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable


def cache_base() -> str:
    """realscale's cache: ``$REALSCALE_CACHE`` or ``~/.cache/realscale``."""
    return os.environ.get("REALSCALE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "realscale")


def cache_root() -> str:
    """Where built-in models are cached: ``$REALSCALE_CACHE/models`` or ``~/.cache/realscale/models``."""
    return os.path.join(cache_base(), "models")


def build_atomically(target: str, build: Callable[[str], None], is_complete: Callable[[str], bool]) -> str:
    """Build a cached directory in a temporary sibling and rename it into place, so a
    crash or a concurrent builder never leaves a half-written ``target``.
    ``build(tmp_dir)`` writes the files; ``is_complete(path)`` recognises a finished copy."""
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=parent)
    try:
        build(tmp)
        if os.path.isdir(target) and not is_complete(target):
            shutil.rmtree(target, ignore_errors=True)  # stale or partial: replace
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):  # lost a race to a broken copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

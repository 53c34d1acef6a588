"""No file in the repository holds a merge-conflict marker (one slipped into README.md once)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<{7}|>{7})( |$)|^={7}$", re.MULTILINE)


def test_no_tracked_file_holds_a_conflict_marker() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for name in files:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".sh", ".txt", ".cpp", ".cu", ".h"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        bad += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in MARKER.finditer(text)]
    assert not bad, f"merge-conflict markers at {', '.join(bad)}"

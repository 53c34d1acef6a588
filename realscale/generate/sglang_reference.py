"""SGLang's own protocol definitions, read from its source package (for contract tests).

SGLang is not installed on CPU machines; ``python scripts/fetch_sglang_source.py`` runs
``pip download --no-deps sglang`` and unpacks the few protocol files into
``$REALSCALE_CACHE/sglang`` (default ``~/.cache/realscale/sglang``). This module finds
them and reads class field names with ``ast``, without importing SGLang.
"""

from __future__ import annotations

import ast
import os

FILES = ("sglang/srt/managers/io_struct.py", "sglang/srt/sampling/sampling_params.py",
         "sglang/srt/entrypoints/http_server.py")


def source_dir() -> str:
    base = os.environ.get("REALSCALE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "realscale")
    return os.path.join(base, "sglang")


def find_source() -> str | None:
    """The directory holding ``sglang/srt/...`` protocol files, or None if not fetched."""
    root = source_dir()
    return root if all(os.path.isfile(os.path.join(root, f)) for f in FILES) else None


def class_fields(path: str, class_name: str) -> dict[str, str]:
    """``{field: annotation source}`` of the annotated class attributes of ``class_name``,
    including those inherited from bases defined in the same file."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if class_name not in classes:
        raise KeyError(f"{class_name} not found in {path}")
    fields: dict[str, str] = {}
    node = classes[class_name]
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(class_fields(path, base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = ast.unparse(stmt.annotation)
    return fields


def fetch(dest: str | None = None) -> str:
    """Download the sglang wheel (no dependencies) and unpack the protocol files."""
    import glob
    import subprocess
    import sys
    import tempfile
    import zipfile

    dest = dest or source_dir()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "sglang",
                        "-d", tmp], check=True)
        wheels = glob.glob(os.path.join(tmp, "sglang-*.whl"))
        if not wheels:
            raise RuntimeError("pip download produced no sglang wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(dest, members=[f for f in FILES if f in zf.namelist()])
            version = os.path.basename(wheels[0]).split("-")[1]
    with open(os.path.join(dest, "VERSION"), "w", encoding="utf-8") as fh:
        fh.write(version + "\n")
    return dest

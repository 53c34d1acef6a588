"""The SGLang version realscale speaks, and SGLang's own source for the contract tests.

``PINNED`` is the SGLang release whose protocol the client, the weight-update group and the
embedded server follow; ``SUPPORTED`` is the range of installed SGLang versions the
launcher accepts (``setup.py``'s ``gpu`` extra pins the same range). Why this range:

- per-token ``weight_versions`` spans in ``meta_info`` exist since 0.5.19; the pause
  ``mode`` and ``--weight-version`` are older;
- since 0.5.21 ``/update_weights_from_distributed`` must run inside a weight-update session
  (``/begin_weight_update`` ... ``/end_weight_update``); the client sends that sequence,
  so older servers (which have no such routes) are outside the range;
- the group creation (``init_custom_process_group``) is the same from 0.5.21 to 0.5.23.

SGLang is not installed on CPU machines. ``python scripts/fetch_sglang_source.py`` runs
``pip download --no-deps sglang==PINNED`` (nothing is installed) and unpacks the protocol
files into ``$REALSCALE_CACHE/sglang`` (default ``~/.cache/realscale/sglang``), together
with the ``msgspec`` wheel that SGLang's generated API contract module needs. This module
finds them, reads class fields and routes with ``ast``, and can execute chosen top-level
definitions of SGLang's source verbatim (:func:`load_definitions`), so a test runs SGLang's
own code without importing its package (whose imports need CUDA-only libraries).
"""

from __future__ import annotations
import __future__

import ast
import functools
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from types import ModuleType
from typing import Any

from realscale.models.cache import cache_base

PINNED = "0.5.23"
SUPPORTED = ">=0.5.21,<0.5.24"
MSGSPEC = "0.22.0"  # for sglang/api/v1/api_types.py (SGLang requires msgspec, unpinned)

FILES = (
    "sglang/srt/managers/io_struct.py",
    "sglang/srt/sampling/sampling_params.py",
    "sglang/srt/entrypoints/http_server.py",
    "sglang/api/v1/api_types.py",
    "sglang/srt/utils/common.py",
    "sglang/srt/utils/network.py",
    "sglang/srt/model_executor/model_runner_components/weight_updater.py",
    "sglang/srt/managers/scheduler_components/weight_updater.py",
    "sglang/srt/managers/tokenizer_manager.py",
    "sglang/srt/managers/schedule_batch.py",
    "sglang/srt/utils/weight_versions.py",
    "sglang/srt/weight_sync/tensor_bucket.py",
)
PREFIXES = ("sglang/srt/arg_groups/fields/",)  # server options, one dataclass field each


def source_dir() -> str:
    return os.path.join(cache_base(), "sglang")


def fetched_version(root: str | None = None) -> str | None:
    path = os.path.join(root or source_dir(), "VERSION")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()


def find_source() -> str | None:
    """The directory holding the pinned version's ``sglang/...`` files, or None if not fetched."""
    root = source_dir()
    if fetched_version(root) != PINNED:
        return None
    return root if all(os.path.isfile(os.path.join(root, f)) for f in FILES) else None


def missing_reason() -> str:
    """Why :func:`find_source` found nothing (a test's skip reason)."""
    have = fetched_version()
    if have is None:
        what = "SGLang source not fetched"
    elif have != PINNED:
        what = f"the cache holds SGLang {have}, not the pinned {PINNED}"
    else:
        what = f"the cached SGLang {PINNED} lacks files this version of realscale reads"
    if _FETCH_ERROR:
        what += f" and fetching it failed ({_FETCH_ERROR[0]})"
    return f"{what}: run 'python scripts/fetch_sglang_source.py' (needs PyPI access)"


@functools.lru_cache(maxsize=64)
def parse(path: str) -> ast.Module:
    """The AST of a source file (cached: tests read the same large files many times; do not
    modify the tree)."""
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read(), filename=path)


def class_fields(path: str, class_name: str) -> dict[str, str]:
    """``{field: annotation source}`` of the annotated class attributes of ``class_name``,
    including those inherited from bases defined in the same file."""
    classes = {n.name: n for n in parse(path).body if isinstance(n, ast.ClassDef)}
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


def _route(decorator: ast.expr) -> tuple[str, set[str]] | None:
    """``@app.get("/x")`` / ``@app.post(...)`` / ``@app.api_route("/x", methods=[...])``."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and isinstance(decorator.func.value, ast.Name) and decorator.func.value.id == "app"):
        return None
    kind = decorator.func.attr
    if not decorator.args or not isinstance(decorator.args[0], ast.Constant):
        return None  # a path computed at runtime (e.g. from an environment variable)
    path = decorator.args[0].value
    if kind in ("get", "post", "put", "delete"):
        return path, {kind.upper()}
    if kind == "api_route":
        methods = next((kw.value for kw in decorator.keywords if kw.arg == "methods"), None)
        return path, {e.value for e in methods.elts} if isinstance(methods, ast.List) else {"GET"}
    return None


def routes(path: str) -> dict[str, set[str]]:
    """``{path: methods}`` of every route a FastAPI module declares at its top level."""
    out: dict[str, set[str]] = {}
    for node in parse(path).body:
        for dec in getattr(node, "decorator_list", []):
            found = _route(dec)
            if found:
                out.setdefault(found[0], set()).update(found[1])
    return out


def function(path: str, name: str, cls: str | None = None) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The AST of top-level function ``name`` (or method ``cls.name``)."""
    body = parse(path).body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise KeyError(f"{cls + '.' if cls else ''}{name} not found in {path}")


def dict_keys(node: ast.AST, target: str) -> set[str]:
    """String keys of every dict literal assigned to ``target`` (``x = {...}``,
    ``x.update({...})``, ``x["k"] = ...``) inside ``node``."""
    keys: set[str] = set()

    def literal(d: ast.AST) -> None:
        if isinstance(d, ast.Dict):
            keys.update(k.value for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))

    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign):
            for t in sub.targets:
                if isinstance(t, ast.Name) and t.id == target:
                    literal(sub.value)
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == target
                        and isinstance(t.slice, ast.Constant)):
                    keys.add(t.slice.value)
        if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "update"
                and isinstance(sub.func.value, ast.Name) and sub.func.value.id == target and sub.args):
            literal(sub.args[0])
    return keys


def _imports_for(tree: ast.Module, picked: list[ast.stmt]) -> list[ast.stmt]:
    """The module's top-level imports (outside SGLang) of names the picked definitions use."""
    used = {n.id for node in picked for n in ast.walk(node) if isinstance(n, ast.Name)}
    out: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            keep = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used
                    and not a.name.startswith("sglang")]
            out += [ast.copy_location(ast.Import(names=[a]), node) for a in keep]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("sglang"):
            keep = [a for a in node.names if (a.asname or a.name) in used]
            out += [ast.copy_location(ast.ImportFrom(module=node.module, names=[a], level=0), node) for a in keep]
    return out


def _defined_name(node: ast.stmt) -> str:
    return node.name if hasattr(node, "name") else node.targets[0].id  # type: ignore[attr-defined]


def load_definitions(rel: str, names: list[str], namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    """Execute the top-level definitions ``names`` (functions, classes, assignments) of the
    pinned SGLang source file ``rel`` verbatim, in source order, and return the namespace.

    The module's own imports of outside packages (stdlib, torch, packaging ...) that those
    definitions use run too, each skipped if it cannot import here; names they take from
    SGLang itself come from ``namespace``. Nothing else of the module runs. Raises KeyError
    if SGLang no longer defines one of ``names`` there."""
    root = find_source()
    if root is None:
        raise FileNotFoundError(missing_reason())
    path = os.path.join(root, rel)
    tree = parse(path)
    picked = [node for node in tree.body
              if (isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.name in names)
              or (isinstance(node, ast.Assign) and len(node.targets) == 1
                  and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names)]
    missing = [n for n in names if n not in {_defined_name(p) for p in picked}]
    if missing:
        raise KeyError(f"{rel} (SGLang {PINNED}) no longer defines {', '.join(missing)}")
    # a real module: dataclasses look their class's module up in sys.modules
    module = ModuleType("_realscale_sglang_ref." + rel.removesuffix(".py").replace("/", "."))
    module.__dict__.update(namespace or {})
    sys.modules[module.__name__] = module
    ns = module.__dict__
    flags = __future__.annotations.compiler_flag
    for node in _imports_for(tree, picked):
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec", flags=flags, dont_inherit=True), ns)
        except ImportError:
            pass  # not installed here; only a definition that uses it would fail
    # SGLang's own source, read for the contract tests
    exec(compile(ast.Module(body=picked, type_ignores=[]), path, "exec", flags=flags, dont_inherit=True), ns)
    return ns


def api_types() -> ModuleType:
    """SGLang's generated HTTP JSON contract (``sglang/api/v1/api_types.py``): decoders that
    raise ``JsonContractError`` exactly where SGLang's server answers 400."""
    root = find_source()
    if root is None:
        raise FileNotFoundError(missing_reason())
    deps = os.path.join(root, "_deps")
    if deps not in sys.path:
        sys.path.append(deps)
    name = "_realscale_sglang_api_types"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "sglang/api/v1/api_types.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _download(requirement: str, into: str) -> str:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement,
                    "-d", into], check=True)
    stem = requirement.split("==")[0]
    wheels = glob.glob(os.path.join(into, f"{stem}-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel for {requirement}")
    return wheels[0]


def fetch(dest: str | None = None) -> str:
    """Download the pinned SGLang wheel (no dependencies, nothing installed), unpack its
    protocol files, and unpack msgspec into ``_deps`` for :func:`api_types`."""

    dest = dest or source_dir()
    staging = f"{dest}.partial-{os.getpid()}"  # unpack beside, then swap: readers never see half a tree
    shutil.rmtree(staging, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download(f"sglang=={PINNED}", tmp)
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            missing = [f for f in FILES if f not in names]
            if missing:
                raise RuntimeError(f"SGLang {PINNED}'s wheel lacks {', '.join(missing)}")
            zf.extractall(staging, members=[n for n in names
                                            if n in FILES or (n.startswith(PREFIXES) and n.endswith(".py"))])
        with zipfile.ZipFile(_download(f"msgspec=={MSGSPEC}", tmp)) as zf:
            zf.extractall(os.path.join(staging, "_deps"))
    with open(os.path.join(staging, "VERSION"), "w", encoding="utf-8") as fh:
        fh.write(PINNED + "\n")
    old = f"{dest}.old-{os.getpid()}"
    if os.path.exists(dest):
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


_FETCH_ERROR: list[str] = []  # why this process's one fetch attempt failed


def ensure_source() -> str | None:
    """:func:`find_source`, fetching the pinned sources first (once per process) when they
    are absent, so the contract tests run on a fresh machine without a setup step. None
    when the fetch failed too (:func:`missing_reason` then says why)."""
    found = find_source()
    if found is not None or _FETCH_ERROR:
        return found
    try:
        fetch()
    except (OSError, RuntimeError, subprocess.SubprocessError, zipfile.BadZipFile) as exc:
        _FETCH_ERROR.append(f"{type(exc).__name__}: {str(exc).splitlines()[-1] if str(exc) else ''}"[:300])
        return None
    return find_source()

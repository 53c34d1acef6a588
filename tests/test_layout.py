"""The house's shape: one concept per folder, floors that only look down.

Every import in the package (at the top of a module, deferred inside a function, or only
for type checking) is read from the source. A folder (or top-level module) may import
its own floor or a lower one, never a higher one; folders on one floor must not form an
import cycle; and no two modules import each other at run time (directly or around a
longer circle). A new folder must be given a floor here and in ARCHITECTURE.md.

``python tests/test_layout.py`` prints the counts the layout issue tracks (upward
arrows, folder and file circles, ``cfg: Any``, deferred imports).
"""

from __future__ import annotations

import ast
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "realscale"

# From the top down; the same list as ARCHITECTURE.md's "Floors".
FLOORS: list[tuple[str, ...]] = [
    ("__main__", "cli", "commands"),
    ("trainer", "sim"),
    ("launcher",),
    ("eval", "sft"),
    ("serve",),
    ("publish", "rollout"),
    ("train", "inference", "planner", "tasks"),
    ("data", "models"),
    ("algo", "parallel", "config", "reward"),
    ("errors", "metrics", "kernels", "_kernels", "_pyast", "__init__"),
]
FLOOR = {unit: len(FLOORS) - i for i, units in enumerate(FLOORS) for unit in units}

# Third-party packages worth deferring: slow to import, or absent where the code may run
# (``realscale --help`` and the launcher's probes import no torch; a CPU run has no vLLM;
# reasoning_gym and tqdm are optional).
HEAVY = ("torch", "megatron", "transformers", "vllm", "sglang", "safetensors", "tensorboard", "wandb",
         "matplotlib", "mpi4py", "math_verify", "gguf", "triton", "numpy", "aiohttp", "requests", "yaml",
         "datasets", "pyarrow", "accelerate", "transformer_engine", "packaging", "psutil", "omegaconf",
         "reasoning_gym", "tqdm")
# heavy modules of a package that is light as a whole: megatron_patches.lazy_jit is
# imported by realscale/__init__.py (standard library only); these two load megatron
HEAVY_MODULES = ("megatron_patches.cpu", "megatron_patches.fixes")


@dataclass(frozen=True)
class Import:
    src: str  # importing module, dotted
    dst: str  # imported module, dotted (realscale.* only for package imports)
    line: int
    kind: str  # "top", "deferred" or "typing"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(src: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = src.split(".") if is_pkg else src.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    out = []
    for alias in node.names:  # ``from realscale.x import y``: y may be a module
        sub = f"{mod}.{alias.name}"
        rel = Path(*sub.split(".")[1:]) if sub.startswith("realscale.") else None
        is_module = rel is not None and ((ROOT / rel).with_suffix(".py").exists() or (ROOT / rel).is_dir())
        out.append(sub if is_module else mod)
    return out


def imports(path: Path) -> list[Import]:
    """Every import statement of one file, with where it sits."""
    src = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[Import] = []

    def walk(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and kind == "top":
                k = "deferred"
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                k = "typing"
            if isinstance(child, ast.Import):
                found.extend(Import(src, a.name, child.lineno, k) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.extend(Import(src, m, child.lineno, k) for m in _resolve(src, path.name == "__init__.py", child))
            walk(child, k)

    walk(tree, "top")
    return found


def all_imports() -> list[Import]:
    return [imp for path in sorted(ROOT.rglob("*.py")) for imp in imports(path)]


def unit(module: str) -> str:
    """The folder (or top-level module) a dotted realscale module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward(imps: list[Import]) -> list[Import]:
    return [i for i in imps if i.dst.startswith("realscale") and FLOOR[unit(i.dst)] > FLOOR[unit(i.src)]]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative enough for this size)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def folder_cycles(imps: list[Import]) -> list[list[str]]:
    edges: dict[str, set[str]] = {}
    for i in imps:
        if i.dst.startswith("realscale") and unit(i.src) != unit(i.dst):
            edges.setdefault(unit(i.src), set()).add(unit(i.dst))
    return _cycles(edges)


def file_cycles(imps: list[Import]) -> list[list[str]]:
    """Module circles through imports that run (top-level or deferred, not type-only)."""
    known = {module_name(p) for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for i in imps:
        if i.kind != "typing" and i.dst in known and i.dst != i.src:
            edges.setdefault(i.src, set()).add(i.dst)
    return _cycles(edges)


def _heavy(name: str) -> str | None:
    for module in HEAVY_MODULES:
        if name == module or name.startswith(module + "."):
            return module
    top = name.split(".")[0]
    return top if top in HEAVY else None


def top_weight(imps: list[Import]) -> dict[str, frozenset[str]]:
    """For each module, the heavy packages importing it loads (through top-level imports)."""
    own: dict[str, set[str]] = {}
    edges: dict[str, set[str]] = {}
    for i in imps:
        own.setdefault(i.src, set())
        if i.kind != "top":
            continue
        if i.dst.startswith("realscale"):
            edges.setdefault(i.src, set()).add(i.dst)
        elif _heavy(i.dst):
            own[i.src].add(_heavy(i.dst))
    weight: dict[str, frozenset[str]] = {}

    def of(m: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
        if m in weight:
            return weight[m]
        got = set(own.get(m, ()))
        parent = m.rsplit(".", 1)[0]  # importing a.b.c runs a.b's __init__ first
        for d in [*edges.get(m, ()), *([parent] if parent != m and parent.startswith("realscale") else [])]:
            if d not in seen:
                got |= of(d, seen | {m})
        weight[m] = frozenset(got)
        return weight[m]

    for m in own:
        of(m)
    return weight


# Scripts that run inside the code sandbox as sources of their own: what they import, and
# when, is part of the sandbox's design (reward/sandbox.py), not a matter of layout.
SANDBOX_SCRIPTS = {"realscale.reward._harness", "realscale.reward._sandbox_exec"}


def loose_deferred(imps: list[Import]) -> list[Import]:
    """Deferred imports that defer nothing: a module whose import loads no heavy package
    the importing module does not load already (the standard library; torch where the
    module imports torch anyway; a realscale module as light as this one). A command
    module's ``run()`` may defer anything (``realscale --help`` imports no command)."""
    weight = top_weight(imps)
    out = []
    for i in imps:
        if i.kind != "deferred" or i.src.startswith("realscale.commands") or i.src == "realscale.cli":
            continue
        if i.src in SANDBOX_SCRIPTS:
            continue
        if i.dst.startswith("realscale"):
            cost = weight.get(i.dst, frozenset())
        else:
            cost = frozenset({_heavy(i.dst)} if _heavy(i.dst) else ())
        if cost <= weight.get(i.src, frozenset()):
            out.append(i)
    return out


def cfg_any() -> list[str]:
    pattern = re.compile(r"\b(cfg|config|gen_cfg|tokenizer|tok)\s*:\s*(\"?)Any\b")
    return [f"{p.relative_to(ROOT.parent)}:{n}" for p in sorted(ROOT.rglob("*.py"))
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]


# ----------------------------------------------------------------------------- the tests


def test_every_folder_has_a_floor() -> None:
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    missing = sorted(units - set(FLOOR))
    assert not missing, f"give these a floor in tests/test_layout.py and ARCHITECTURE.md: {missing}"


def test_no_import_runs_up_a_floor() -> None:
    bad = [f"{i.src} ({unit(i.src)}, floor {FLOOR[unit(i.src)]}) imports {i.dst} ({unit(i.dst)}, floor "
           f"{FLOOR[unit(i.dst)]}) at line {i.line}" for i in upward(all_imports())]
    assert not bad, "imports that run up a floor:\n" + "\n".join(bad)


def test_no_folders_import_each_other() -> None:
    assert folder_cycles(all_imports()) == []


def test_no_modules_import_each_other() -> None:
    assert file_cycles(all_imports()) == []


def test_deferred_imports_defer_something() -> None:
    loose = [f"{i.src}:{i.line} defers {i.dst}" for i in loose_deferred(all_imports())]
    assert not loose, "move these to the top of their module:\n" + "\n".join(loose)


def test_seams_are_typed() -> None:
    """No bare ``cfg: Any`` / ``tokenizer: Any``: a config is a :class:`realscale.config.Config`
    or the section it reads, a tokenizer a :class:`realscale.data.tokens.Tokenizer`."""
    bare = cfg_any()
    assert not bare, "give these a type (Config or its section, Tokenizer):\n" + "\n".join(bare)


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """The reader finds an upward arrow, a folder circle and a loose deferred import."""
    global ROOT
    pkg = tmp_path / "realscale"
    for folder, text in {"algo": "from realscale.trainer import loop\n",
                         "trainer": "def loop():\n    import os\n    from realscale.algo import x\n"}.items():
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text(text)
    saved, ROOT = ROOT, pkg
    try:
        imps = all_imports()
        assert [(i.src, i.dst) for i in upward(imps)] == [("realscale.algo", "realscale.trainer")]
        assert folder_cycles(imps) == [["algo", "trainer"]]
        assert {i.dst for i in loose_deferred(imps)} == {"os", "realscale.algo"}
        (pkg / "trainer" / "__init__.py").write_text("def loop():\n    import torch\n")
        assert loose_deferred(all_imports()) == []  # torch is worth deferring in a module without it
    finally:
        ROOT = saved


if __name__ == "__main__":
    imps = all_imports()
    print(f"upward arrows:        {len(upward(imps))}")
    print(f"folder circles:       {len(folder_cycles(imps))} {folder_cycles(imps)}")
    print(f"file circles:         {len(file_cycles(imps))} {file_cycles(imps)}")
    print(f"cfg/tokenizer: Any:   {len(cfg_any())}")
    print(f"deferred imports:     {sum(i.kind == 'deferred' for i in imps)} "
          f"(of which defer nothing: {len(loose_deferred(imps))})")
    if "-v" in sys.argv:
        for i in upward(imps):
            print("  up:", i)
        for i in loose_deferred(imps):
            print("  loose:", f"{i.src}:{i.line} {i.dst}")
        for line in cfg_any():
            print("  any:", line)
    sys.exit(0 if os.environ.get("LAYOUT_STRICT") is None else int(bool(upward(imps))))

"""Sandbox: the policy never weakens silently; the probe names exactly what is missing;
without root the reward refuses, or (allowed) runs weaker with one warning and a count."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from realscale.reward.sandbox import (LAYERS, Isolation, SandboxRefused, choose_layers, elf_interpreter,
                                      probe_isolation, shared_sandbox)

FULL = {layer: True for layer in LAYERS}


def _missing(*layers: str) -> Isolation:
    return Isolation({k: k not in layers for k in LAYERS}, {k: f"no {k} here" for k in layers})


def test_policy_refuses_unless_allowed_and_never_runs_as_root() -> None:
    assert choose_layers(Isolation(FULL), allow_weaker=False, is_root=True) == FULL
    with pytest.raises(SandboxRefused, match="missing cgroup: no cgroup here"):
        choose_layers(_missing("cgroup"), allow_weaker=False, is_root=True)
    assert choose_layers(_missing("cgroup"), allow_weaker=True, is_root=True) == {**FULL, "cgroup": False}
    with pytest.raises(SandboxRefused, match="cannot drop root"):
        choose_layers(_missing("uid", "mount"), allow_weaker=True, is_root=True)
    assert choose_layers(_missing("uid", "mount"), allow_weaker=True, is_root=False)["pid"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the full sandbox needs root; without it every layer is missing")
def test_all_layers_work_here_as_root() -> None:
    iso = probe_isolation()
    assert iso.full, iso.missing


def test_an_interpreter_that_cannot_be_inspected_is_refused() -> None:
    with pytest.raises(SandboxRefused, match="cannot inspect the interpreter /nonexistent/python"):
        shared_sandbox("/nonexistent/python").probe()


def test_elf_interpreter_is_found() -> None:
    interp = elf_interpreter(os.path.realpath(sys.executable))
    assert interp and os.path.exists(interp)
    assert elf_interpreter(__file__) is None


_AS_NOBODY = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from realscale.reward.code_reward import CodeReward
ok = ("def add(a, b):\n    return a + b\n", "assert add(1, 2) == 3")
out = {}
with CodeReward(concurrency=1, timeout=10.0) as strict:
    out["missing"] = strict.isolation.missing
    out["strict"] = [(r.value, r.reason, r.detail) for r in strict.score_batch([ok])]
with CodeReward(concurrency=1, timeout=10.0, allow_weaker=True) as weak:
    out["weak"] = [(r.value, r.reason, r.detail) for r in weak.score_batch([ok, ok, ("def add(a, b):\n    return 0\n", ok[1])])]
    out["stats"] = weak.stats()
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="needs root to become an unprivileged user (setpriv) and a system Python it can read")
def test_without_root_it_refuses_or_warns_once_when_allowed(tmp_path) -> None:
    """A trainer that is not root (uid 65534 here) gets no layer but a cgroup it cannot
    create: each layer says why; runs are refused; allowed, they run with one warning."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # the checkout may sit where uid 65534 cannot read (a 0700 mktemp dir): give it a copy
    pkg = tmp_path / "pkg"
    shutil.copytree(os.path.join(repo, "realscale"), pkg / "realscale",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pkg), "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    for path in (tmp_path, *tmp_path.parents[:2]):  # pytest's own base directories are 0700
        os.chmod(path, os.stat(path).st_mode | 0o711)
    os.chmod(tmp_path, 0o777)
    for root, dirs, files in os.walk(pkg):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755)
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                          _AS_NOBODY], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert sorted(got["missing"]) == sorted(LAYERS)  # exactly the six layers, none invented
    assert all(got["missing"][k].startswith("needs root") for k in ("uid", "pid", "mount", "net", "ipc"))
    assert got["missing"]["cgroup"].startswith("no usable cgroup")
    [(value, reason, detail)] = got["strict"]
    assert (value, reason) == (0.0, "sandbox") and "missing" in detail
    assert [(v, r) for v, r, _ in got["weak"]] == [(1.0, "ok"), (1.0, "ok"), (0.0, "ok")]
    assert got["stats"]["sandbox_weakened"] == 3
    assert out.stderr.count("running WITHOUT a full sandbox") == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="the layer-by-layer probe runs only when every layer could work (root)")
def test_probe_names_exactly_the_layer_that_fails(monkeypatch) -> None:
    """When the full sandbox fails, each layer is tried on its own (the uid on top of the
    minimal root) and only the failing one is reported, with its own reason."""
    from realscale.reward.sandbox import Sandbox

    real_try = Sandbox._try

    def ipc_broken(self: Sandbox, layers: dict[str, bool]) -> str | None:
        return "ipc namespace refused" if layers["ipc"] else real_try(self, layers)

    monkeypatch.setattr(Sandbox, "_try", ipc_broken)
    iso = Sandbox(state_dir="/run/realscale-sandbox").probe()
    assert iso.missing == {"ipc": "ipc namespace refused"}
    assert iso.layers == {**FULL, "ipc": False}

"""Sandbox: the policy never weakens silently; the probe names exactly what is missing.
Without root (user namespaces, or the refusal where they are forbidden) see
``test_sandbox_userns.py``."""

from __future__ import annotations

import os
import sys

import pytest

from realscale.reward.sandbox import (LAYERS, USERNS_LAYERS, Isolation, SandboxRefused, choose_layers,
                                      elf_interpreter, nproc_per_userns, probe_isolation, shared_sandbox)

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


def test_unprivileged_policy_needs_every_userns_layer() -> None:
    full = {**{k: True for k in USERNS_LAYERS}, "uid": False, "cgroup": False}
    iso = Isolation(full, {}, "userns", {"cgroup": "not delegated"})
    assert iso.full and choose_layers(iso, allow_weaker=False, is_root=False) == full  # a note is no refusal
    with pytest.raises(SandboxRefused, match="missing nproc: old kernel"):
        choose_layers(Isolation({**full, "nproc": False}, {"nproc": "old kernel"}, "userns"), False, False)
    assert not nproc_per_userns("5.10.0-28-amd64") and nproc_per_userns("5.14.0") and nproc_per_userns("6.18.44-x")


@pytest.mark.skipif(os.geteuid() != 0, reason="the root sandbox needs root")
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

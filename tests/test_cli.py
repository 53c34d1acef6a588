"""The realscale command: fast help, no heavy imports at start-up, real subcommands."""

from __future__ import annotations

import subprocess
import sys
import time

from realscale import cli


def test_help_lists_every_command_and_is_fast() -> None:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "realscale", "--help"], capture_output=True, text=True, timeout=30)
    elapsed = time.perf_counter() - start
    assert out.returncode == 0
    for name in cli.COMMANDS:
        assert name in out.stdout
    assert elapsed < 1.5, f"realscale --help took {elapsed:.2f} s"


def test_help_imports_no_torch() -> None:
    code = "import sys; from realscale import cli; cli.main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip().endswith("False")


def test_every_command_module_is_real() -> None:
    import importlib

    for name, (module, _) in cli.COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.run), name


def test_unknown_command_suggests() -> None:
    out = subprocess.run([sys.executable, "-m", "realscale", "confg"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "did you mean 'config'" in out.stderr


def test_config_show_prints_resolved_yaml() -> None:
    out = subprocess.run([sys.executable, "-m", "realscale", "config", "show", "configs/tiny_cpu.yaml",
                          "rollout.max_staleness=7"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "max_staleness: 7" in out.stdout

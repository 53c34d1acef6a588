"""``load_tokenizer`` is ``AutoTokenizer.from_pretrained`` with its choice of class
remembered: the same class and the same ids in a later process that never imports
``AutoTokenizer`` (transformers 5.19: ``models/auto/tokenization_auto.py`` 844-879 picks
``Qwen2Tokenizer`` for a Qwen2 directory whose ``tokenizer_config.json`` names
``TokenizersBackend``), and a changed directory asks ``AutoTokenizer`` again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from realscale.models.tiny import resolve_model_path

PROBE = """
import json, sys
from realscale.data.tokens import prompt_ids
from realscale.models.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1])
print(json.dumps({"cls": type(tok).__module__ + ":" + type(tok).__qualname__,
                  "auto": "transformers.models.auto.tokenization_auto" in sys.modules,
                  "ids": prompt_ids(tok, "23+19="), "enc": tok.encode("(3+9=12,2+1+1=4)42"),
                  "eos": tok.eos_token_id}))
"""


def _probe(model: str, cache: str) -> dict:
    env = {**os.environ, "REALSCALE_CACHE": cache}
    out = subprocess.run([sys.executable, "-c", PROBE, model], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_later_process_loads_the_class_autotokenizer_chose_without_it(tmp_path) -> None:
    from transformers import AutoTokenizer

    model = resolve_model_path("tiny-qwen2")
    auto = AutoTokenizer.from_pretrained(model)
    first = _probe(model, str(tmp_path))  # goes through AutoTokenizer and records its choice
    second = _probe(model, str(tmp_path))
    assert first["auto"] and not second["auto"]
    assert first["cls"] == second["cls"] == f"{type(auto).__module__}:{type(auto).__qualname__}"
    assert first["cls"].endswith(":Qwen2Tokenizer")  # not the TokenizersBackend the directory names
    assert first["ids"] == second["ids"] and first["enc"] == second["enc"] and first["eos"] == second["eos"]
    assert second["enc"] == auto.encode("(3+9=12,2+1+1=4)42")
    assert len(json.load(open(tmp_path / "tokenizer_classes.json"))) == 1


def test_a_changed_directory_or_an_unknown_class_goes_through_autotokenizer(tmp_path) -> None:
    import shutil

    src = resolve_model_path("tiny-qwen2")
    model = tmp_path / "model"
    shutil.copytree(src, model)
    cache = tmp_path / "cache"
    assert _probe(str(model), str(cache))["auto"]
    assert not _probe(str(model), str(cache))["auto"]
    cfg = model / "tokenizer_config.json"
    os.utime(cfg, ns=(os.stat(cfg).st_atime_ns, os.stat(cfg).st_mtime_ns + 10**9))  # edited
    assert _probe(str(model), str(cache))["auto"]
    records = json.load(open(cache / "tokenizer_classes.json"))
    assert len(records) == 2  # the old key stays harmless; the new one is used
    for key in records:
        records[key] = "transformers:NoSuchTokenizer"  # (a record from another transformers)
    (cache / "tokenizer_classes.json").write_text(json.dumps(records))
    assert _probe(str(model), str(cache))["auto"]

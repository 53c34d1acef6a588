"""``LightTokenizer`` gives the ids, text and chat-template renderings of the Hugging Face
tokenizer it was snapshotted from (transformers 5.19, ``tokenization_utils_tokenizers.py``
``_encode_plus`` 1043-1055 / ``_decode`` 1122-1135, ``utils/chat_template_utils.py`` 426-501),
a later process builds it without importing transformers or torch, and the snapshots are
refused, replaced and bounded as ``realscale/models/tokenizer.py`` says."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from realscale.data.tokens import observation_ids, prompt_ids
from realscale.models.light_tokenizer import LightTokenizer, snapshot_of
from realscale.models.tiny import resolve_model_path

TEXTS = ["23+19=", "(3+9=12,2+1+1=4)42", "", " ", "  two  spaces\n\tand a tab\r\n", "Hello, World! It's 3.14.",
         "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>after", "x<|im_end|>y<|im_start|>", "éß中文🙂 naïve",
         "<answer>85</answer>", "def f(x):\n    return x ** 2  # squared", "\\frac{1}{2} $x^2$"]
CONVERSATIONS = [
    [{"role": "user", "content": "23+19="}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}],
    [{"role": "tool", "content": "<result>4</result>"}],
    [{"role": "user", "content": "<|im_end|> inside a message, and \"quotes\" & <tags>"}],
]


def _smollm2_tokenizer_dir(tmp: str) -> str:
    """SmolLM2-135M-Instruct's tokenizer as our GGUF loader writes it (only the tokenizer)."""
    from realscale.models.gguf import missing_requirements, smollm2_gguf_path

    if missing_requirements():
        pytest.skip(f"SmolLM2's GGUF needs {missing_requirements()}")
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf), local_files_only=True)
    tok.save_pretrained(tmp)
    return tmp


@pytest.fixture(params=["tiny-qwen2", "smollm2"])
def tokenizer_dir(request, tmp_path) -> str:
    if request.param == "smollm2":
        return _smollm2_tokenizer_dir(str(tmp_path / "smollm2"))
    return resolve_model_path(request.param)


def test_light_tokenizer_matches_hugging_face(tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    snap = snapshot_of(hf)
    assert snap is not None
    light = LightTokenizer(json.loads(json.dumps(snap)), tokenizer_dir)  # as stored: through JSON
    for text in TEXTS:
        for special in (True, False):
            assert light.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
            assert light(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"]
        assert light.encode(text) == hf.encode(text)
    rng = random.Random(0)
    specials = [i for i in (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) if i is not None]
    samples = [hf.encode(t) for t in TEXTS] + [[rng.randrange(len(hf)) for _ in range(rng.randint(1, 40))] + specials
                                               for _ in range(200)]
    for ids in samples:
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
        assert [light.decode([i]) for i in ids] == [hf.decode([i]) for i in ids]  # the server's per-token pieces
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert light.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen) == text
            assert (light.apply_chat_template(conv, add_generation_prompt=gen)["input_ids"]
                    == hf.apply_chat_template(conv, add_generation_prompt=gen)["input_ids"])
            assert (light.apply_chat_template(conv, add_generation_prompt=gen, return_dict=False)
                    == hf.apply_chat_template(conv, add_generation_prompt=gen, return_dict=False))
    for prompt in ("23+19=", "Natalia sold clips to 48 of her friends."):
        assert prompt_ids(light, prompt) == prompt_ids(hf, prompt)
        assert observation_ids(light, prompt) == observation_ids(hf, prompt)
    assert ((light.eos_token_id, light.bos_token_id, light.pad_token_id, light.unk_token_id)
            == (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id, hf.unk_token_id))
    assert light.convert_tokens_to_ids(hf.eos_token) == hf.eos_token_id
    assert len(light) == len(hf)


def test_options_it_does_not_reproduce_are_refused_by_name() -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    light = LightTokenizer(snapshot_of(hf))
    with pytest.raises(TypeError, match="return_offsets_mapping"):
        light("23+19=", return_offsets_mapping=True)
    with pytest.raises(TypeError, match="continue_final_message"):
        light.apply_chat_template(CONVERSATIONS[0], continue_final_message=True)
    with pytest.raises(TypeError, match="one conversation"):
        light.apply_chat_template([CONVERSATIONS[0], CONVERSATIONS[1]])
    with pytest.raises(ValueError, match="version"):
        LightTokenizer({**snapshot_of(hf), "version": 0})
    assert light("23+19=", return_tensors=None)["input_ids"] == hf("23+19=")["input_ids"]  # a default is fine


def test_no_snapshot_where_the_class_or_its_decode_does_more() -> None:
    from transformers import AutoTokenizer

    path = resolve_model_path("tiny-qwen2")
    hf = AutoTokenizer.from_pretrained(path)

    class OwnDecode(type(hf)):
        def _decode(self, token_ids, **kwargs):  # type: ignore[no-untyped-def]
            return super()._decode(token_ids, **kwargs).upper()

    assert snapshot_of(OwnDecode.from_pretrained(path)) is None
    assert snapshot_of(AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=True)) is None
    assert snapshot_of(hf) is not None


PROBE = """
import json, sys
from realscale.data.tokens import prompt_ids
from realscale.models.tokenizer import load_light_tokenizer
tok = load_light_tokenizer(sys.argv[1])
print(json.dumps({"cls": type(tok).__name__, "transformers": "transformers" in sys.modules,
                  "torch": "torch" in sys.modules, "ids": prompt_ids(tok, "23+19="),
                  "dec": tok.decode(tok.encode("(3+9=12,2+1+1=4)42<|endoftext|>"), skip_special_tokens=True),
                  "eos": tok.eos_token_id}))
"""


def _probe(model: str, cache: str) -> dict:
    env = {**os.environ, "REALSCALE_CACHE": cache}
    out = subprocess.run([sys.executable, "-c", PROBE, model], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_later_process_loads_it_without_transformers_or_torch(tmp_path) -> None:
    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny-qwen2"), model)
    cache = str(tmp_path / "cache")
    first = _probe(str(model), cache)  # through transformers; records the snapshot
    second = _probe(str(model), cache)
    assert first["cls"] != "LightTokenizer" and first["transformers"]
    assert second["cls"] == "LightTokenizer" and not second["transformers"] and not second["torch"]
    assert first["ids"] == second["ids"] and first["dec"] == second["dec"] == "(3+9=12,2+1+1=4)42"
    assert first["eos"] == second["eos"]
    export = tmp_path / "export"  # same tokenizer files elsewhere (a run's exported checkpoint): same snapshot
    shutil.copytree(model, export)
    assert _probe(str(export), cache)["cls"] == "LightTokenizer"
    # an edited chat template is another tokenizer: transformers again, then a new snapshot
    (model / "chat_template.jinja").write_text((model / "chat_template.jinja").read_text().replace("assistant", "model"))
    third = _probe(str(model), cache)
    assert third["cls"] != "LightTokenizer" and third["ids"] != first["ids"]
    fourth = _probe(str(model), cache)
    assert fourth["cls"] == "LightTokenizer" and fourth["ids"] == third["ids"]


def test_snapshots_are_bounded_and_a_broken_one_falls_back(tmp_path, monkeypatch, caplog) -> None:
    from realscale.models import tokenizer as T

    monkeypatch.setenv("REALSCALE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(T, "MAX_SNAPSHOTS", 2)
    models = []
    for i in range(3):  # three tokenizers: their chat templates differ
        models.append(str(tmp_path / f"model{i}"))
        shutil.copytree(resolve_model_path("tiny-qwen2"), models[-1])
        with open(os.path.join(models[-1], "chat_template.jinja"), "a", encoding="utf-8") as fh:
            fh.write(" " * (i + 1))
        T.load_tokenizer(models[-1])
    folder = tmp_path / "cache" / "tokenizer_snapshots"
    assert len([p for p in os.listdir(folder) if p.endswith(".json")]) == 2
    assert isinstance(T.load_light_tokenizer(models[-1]), LightTokenizer)
    assert not isinstance(T.load_light_tokenizer(models[0]), LightTokenizer)  # evicted: loaded by transformers
    snap = T._snapshot_file(T._snapshot_key(models[-1]))
    with open(snap, "w", encoding="utf-8") as fh:
        fh.write("{not json")
    tok = T.load_light_tokenizer(models[-1])
    assert not isinstance(tok, LightTokenizer) and "unreadable" in caplog.text
    assert tok.encode("23+19=") == LightTokenizer(snapshot_of(tok)).encode("23+19=")

"""The load fleet (benchmarks/_load_fleet.py) answers in the real engines' reply shapes.

SGLang 0.5.23 builds a ``/generate`` answer in ``sglang/srt/managers/tokenizer_manager.py``:
``meta_info`` = id, finish_reason, prompt_tokens, weight_version, num_retractions
(:2507-2513); with ``return_logprob``, input_token_logprobs, output_token_logprobs
(``[logprob, token_id, text or None]``) and output_token_logprobs_length (:2865-2870);
reasoning_tokens, completion_tokens, cached_tokens (:2553-2559); weight_versions spans
(``utils/weight_versions.py:99-107``); e2e_latency once finished (:2753); the answer is
``{"text", "output_ids", "meta_info"}`` (:2651-2655). Finish reasons:
``managers/schedule_batch.py:284-345``. Where the pinned source is on this machine
(``sglang_reference``), every cited line is read and must hold the key.

vLLM 0.32's ``/inference/v1/generate`` answers ``GenerateTokensResponse.model_dump()``
(``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``); where vLLM is installed
its classes' fields are read with ``ast`` and must be the reply's keys exactly.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import os
import sys
from typing import Any

import aiohttp
import pytest

from realscale.inference import sglang_reference as ref
from realscale.inference.client import InferenceClient
from realscale.inference.dialect import Dialect
from realscale.inference.vllm_dialect import VllmDialect

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "_load_fleet.py")
_spec = importlib.util.spec_from_file_location("_load_fleet", _PATH)
fleet_mod = importlib.util.module_from_spec(_spec)
sys.modules["_load_fleet"] = fleet_mod  # its dataclasses look their module up while they are made
_spec.loader.exec_module(fleet_mod)

TAIL = tuple((ord(c), c) for c in " \\boxed{7}")
SGLANG_META = {  # key -> (file, first line, last line) of the pinned source that sets it
    "id": ("managers/tokenizer_manager.py", 2507, 2513), "finish_reason": ("managers/tokenizer_manager.py", 2507, 2513),
    "prompt_tokens": ("managers/tokenizer_manager.py", 2507, 2513),
    "weight_version": ("managers/tokenizer_manager.py", 2507, 2513),
    "num_retractions": ("managers/tokenizer_manager.py", 2507, 2513),
    "reasoning_tokens": ("managers/tokenizer_manager.py", 2553, 2559),
    "completion_tokens": ("managers/tokenizer_manager.py", 2553, 2559),
    "cached_tokens": ("managers/tokenizer_manager.py", 2553, 2559),
    "input_token_logprobs": ("managers/tokenizer_manager.py", 2865, 2870),
    "output_token_logprobs": ("managers/tokenizer_manager.py", 2865, 2870),
    "output_token_logprobs_length": ("managers/tokenizer_manager.py", 2865, 2870),
    "weight_versions": ("utils/weight_versions.py", 99, 107),
    "e2e_latency": ("managers/tokenizer_manager.py", 2753, 2753),
}


def _script(rate: float = 20000.0, lengths: str = "lognormal:300:0.2", slots: int = 4) -> Any:
    filler = tuple((ord(c), c) for c in "Let us think. ")
    return fleet_mod.Script(rate, slots, fleet_mod.LengthLaw.parse(lengths), filler, (TAIL,), 0, abort_poll_s=0.05)


async def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        assert resp.status == 200
        return json.loads(await resp.read())


def test_sglang_reply_shape() -> None:
    async def run() -> dict[str, Any]:
        async with fleet_mod.Fleet(_script(), 1, "sglang", longest=4096) as fleet:
            return await _post(fleet.urls[0] + "/generate", {"input_ids": [1, 2, 3], "rid": "r1",
                                                            "sampling_params": {"max_new_tokens": 2000},
                                                            "return_logprob": True})

    reply = asyncio.run(run())
    assert set(reply) == {"text", "output_ids", "meta_info"}
    meta, n = reply["meta_info"], len(reply["output_ids"])
    assert set(meta) == set(SGLANG_META)
    assert meta["finish_reason"] == {"type": "stop", "matched": 0} and meta["completion_tokens"] == n
    assert meta["prompt_tokens"] == 3 and meta["id"] == "r1" and meta["output_token_logprobs_length"] == n
    assert all(isinstance(lp, float) and tok == t and text is None
               for (lp, tok, text), t in zip(meta["output_token_logprobs"], reply["output_ids"]))
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": n}]
    assert reply["text"].endswith("\\boxed{7}") and len(reply["text"]) == n - 1  # the end-of-sequence piece is ""
    seg = Dialect().parse_generate(reply)
    assert (len(seg.ids), len(seg.logprobs), seg.versions[0]) == (n, n, 0)
    src = ref.find_source()
    if src is not None:  # the citations, read from the pinned source
        for key, (rel, a, b) in SGLANG_META.items():
            with open(os.path.join(src, "sglang", "srt", rel), encoding="utf-8") as fh:
                lines = fh.read().splitlines()[a - 1:b]
            assert any(f'"{key}"' in line for line in lines), f"{rel}:{a}-{b} does not set {key}"


def _fields(tree: ast.Module, *classes: str) -> set[str]:
    by_name = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    return {s.target.id for c in classes for s in by_name[c].body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def test_vllm_reply_shape() -> None:
    async def run() -> dict[str, Any]:
        async with fleet_mod.Fleet(_script(), 1, "vllm", longest=4096) as fleet:
            return await _post(fleet.urls[0] + "/inference/v1/generate",
                               VllmDialect().generate_body([1, 2, 3], {"max_new_tokens": 40}, "r2"))

    reply = asyncio.run(run())
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 40
    seg = VllmDialect().parse_generate(reply)
    assert (len(seg.ids), len(seg.logprobs), seg.versions, seg.finish_reason) == (40, 40, [0] * 40, {"type": "length"})
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return
    path = os.path.join(list(spec.submodule_search_locations)[0], "entrypoints", "scale_out", "token_in_token_out",
                        "protocol.py")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    assert set(reply) == _fields(tree, "GenerateResponseBase", "GenerateTokensResponse")
    assert set(choice) == _fields(tree, "GenerateChoiceBase", "GenerateTokensChoice")
    assert set(choice["logprobs"]) == _fields(tree, "GenerateLogProbs")
    assert set(choice["logprobs"]["content"][0]) == _fields(tree, "GenerateLogProb", "GenerateLogProbsContent")


def test_an_abort_pause_answers_partial_output_and_the_answer_goes_on() -> None:
    async def run() -> tuple[Any, float]:
        # 400 tokens at 250/s: 1.6 s of answer, so the pause 0.15 s in lands mid-answer even when
        # the first request is slow to start (at 1,000/s it failed once in a full default-tier run)
        async with fleet_mod.Fleet(_script(rate=250.0, lengths="lognormal:400:0.01"), 2, "sglang",
                                   longest=4096) as fleet:
            async with InferenceClient(fleet.urls) as client:
                task = asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 1000}))
                await asyncio.sleep(0.15)
                await client.pause("abort")
                await client.update_weights_from_disk("fleet", 1)
                await client.resume()
                return await task, fleet.shared.counters.aborted

    res, aborted = asyncio.run(run())
    assert aborted == 1 and res.num_interruptions == 1
    # one answer, its length drawn once (median 400, sigma 0.01), its tail once at its end
    assert 390 <= len(res.output_ids) <= 410 and res.finish_reason["type"] == "stop"
    assert res.text.count("\\boxed{7}") == 1 and res.text.endswith("\\boxed{7}")
    assert res.output_versions[0] == 0 and res.output_versions[-1] == 1


def test_length_laws() -> None:
    import random

    rng = random.Random(0)
    tail = fleet_mod.LengthLaw.parse("powerlaw:10:1000:1.5")
    draws = [tail.draw(rng) for _ in range(2000)]
    assert 10 <= min(draws) and max(draws) <= 1000 and sorted(draws)[1000] < 60  # median near 40: a long tail
    with pytest.raises(ValueError, match="expected"):
        fleet_mod.LengthLaw.parse("normal:3:1")

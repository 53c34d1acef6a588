"""Embedded server: every endpoint, bad input, log-probs vs transformers, continuous batching."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import requests
import torch

from realscale.algo.sampling import token_logprobs


def _post(url: str, path: str, body=None, **kw) -> requests.Response:
    return requests.post(url + path, json=body, timeout=60, **kw)


def test_generate_fields(tiny_server) -> None:
    url, _ = tiny_server
    r = _post(url, "/generate", {"input_ids": [5, 6, 7], "rid": "abc", "return_logprob": True,
                                 "sampling_params": {"max_new_tokens": 9, "temperature": 0.8, "top_k": 20}})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "abc" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 9
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert len(out["output_ids"]) == 9 and len(meta["output_token_logprobs"]) == 9
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[0] <= 0.0 for e in meta["output_token_logprobs"])
    assert meta["weight_version"] == "0" and meta["weight_versions"] == [{"version": "0", "start": 0, "end": 9}]


def test_text_batch_and_stops(tiny_server) -> None:
    url, server = tiny_server
    tok = server.tokenizer
    batch = _post(url, "/generate", {"text": ["ab", "cde"], "sampling_params": {"max_new_tokens": 4,
                                                                                "temperature": 0}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[1]["meta_info"]["prompt_tokens"] == len(tok("cde")["input_ids"])
    # Greedy is deterministic: find its 3rd token, then stop on it by id and by string.
    greedy = _post(url, "/generate", {"input_ids": [40, 41], "sampling_params": {"max_new_tokens": 6,
                                                                                "temperature": 0}}).json()
    third = greedy["output_ids"][2]
    by_id = _post(url, "/generate", {"input_ids": [40, 41], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [third]}}).json()
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    assert by_id["output_ids"] == greedy["output_ids"][:by_id["output_ids"].index(third) + 1]
    piece = tok.decode([third])
    by_str = _post(url, "/generate", {"input_ids": [40, 41], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop": piece}}).json()
    assert by_str["meta_info"]["finish_reason"]["type"] == "stop"
    assert piece not in by_str["text"]  # SGLang trims the stop string from the text
    zero = _post(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}).json()
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("body, needle", [
    ({"input_ids": [1], "text": "a"}, "exactly one of"),
    ({}, "exactly one of"),
    ({"input_ids": [1], "image_data": "cat.png"}, "generate.image_data: not supported"),
    ({"input_ids": [1], "lora_path": "adapter"}, "generate.lora_path: not supported"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 0}, "generate.logprob_start_len: not supported"),
    ({"input_ids": [[1], [2]], "return_logprob": [True]}, "a list of 1 for a batch of 2"),
    ({"input_ids": [100000]}, "not a token id"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": ["a"]}, "not a token id"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}}, "max_new_tokens: expected int"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n: not supported"),
    ({"input_ids": [1], "sampling_params": {"stop": [1]}}, "sampling_params.stop"),
    ({"input_ids": [1], "sampling_params": {"wat": 1}}, "unknown field(s) 'wat'"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty: not supported"),
    ({"input_ids": [1], "stream": "yes"}, "generate.stream: expected bool"),
    ({"input_ids": [1] * 300}, "context length is 256"),
    ([1, 2], "expected a JSON object"),
])
def test_generate_rejects(tiny_server, body, needle) -> None:
    url, _ = tiny_server
    r = _post(url, "/generate", body)
    assert r.status_code == 400
    assert needle in r.json()["error"]


def test_control_endpoints_reject(tiny_server) -> None:
    url, _ = tiny_server
    assert "not valid JSON" in requests.post(url + "/generate", data="{x", timeout=10).json()["error"]
    cases = [("/pause_generation", {"mode": "freeze"}, "mode"),
             ("/update_weights_from_disk", {}, "model_path"),
             ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "not a directory"),
             ("/init_weights_update_group", {"master_address": "x"}, "master_port"),
             ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": []}, "differ in length"),
             ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]},
              "must run between begin_weight_update() and end_weight_update()"),
             ("/end_weight_update", {}, "no weight-update session is open"),
             ("/begin_weight_update", {"selector": "both"}, "selector")]
    for path, body, needle in cases:
        r = _post(url, path, body)
        assert r.status_code == 400, path
        assert needle in r.json()["error"], (path, r.json())
    assert requests.get(url + "/nope", timeout=10).status_code == 404
    assert requests.get(url + "/generate", timeout=10).json()["error"].startswith("Method Not Allowed")


def test_info_health_flush(tiny_server) -> None:
    url, _ = tiny_server
    for path in ("/health", "/health_generate"):
        assert requests.get(url + path, timeout=30).status_code == 200
    info = requests.get(url + "/get_model_info", timeout=10).json()
    assert info["is_generation"] is True and info["model_type"] == "qwen2"
    assert info["architectures"] == ["Qwen2ForCausalLM"] and info["weight_version"] == "0"
    sinfo = requests.get(url + "/get_server_info", timeout=10).json()
    assert sinfo["context_length"] == 256 and sinfo["max_running_requests"] == 16
    assert sinfo["num_running_reqs"] == 0
    assert requests.post(url + "/flush_cache", timeout=10).status_code == 200


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-qwen3", "tiny-llama"])
def test_logprobs_match_transformers(family: str) -> None:
    """Behaviour log-probs equal log_softmax(logits / T) of a plain HF forward (fp32)."""
    from transformers import AutoModelForCausalLM

    from realscale.serve.server import EmbeddedServer, start_in_thread

    server = EmbeddedServer(family, max_running=8, context_length=128)
    url, stop = start_in_thread(server)
    try:
        prompts = [[3, 4, 5], list(range(10, 40)), [7]]
        temps = [0.7, 1.0, 0.0]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # concurrent: batched decode with padding
            replies = list(pool.map(lambda a: _post(url, "/generate", {
                "input_ids": a[0], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 24, "temperature": a[1], "top_p": 0.9}}).json(),
                zip(prompts, temps)))
    finally:
        stop()
    model = AutoModelForCausalLM.from_pretrained(server.model_path).eval()
    for prompt, temp, reply in zip(prompts, temps, replies):
        out = reply["output_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
        ref = token_logprobs(logits, torch.tensor(out), temp)
        got = torch.tensor([e[0] for e in reply["meta_info"]["output_token_logprobs"]])
        assert (ref - got).abs().max().item() < 1e-4
        if temp == 0.0:
            assert out == logits.argmax(-1).tolist()


def test_short_request_not_held_up_by_long_one(tiny_server) -> None:
    url, _ = tiny_server
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long_ = pool.submit(_post, url, "/generate", {"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True}})
        time.sleep(0.05)
        t0 = time.monotonic()
        short = pool.submit(_post, url, "/generate", {"input_ids": [3], "sampling_params": {
            "max_new_tokens": 3, "ignore_eos": True}}).result()
        short_done = time.monotonic()
        assert not long_.done()  # the short one joined the running batch and left first
        assert long_.result().json()["meta_info"]["completion_tokens"] == 200
    assert short.json()["meta_info"]["completion_tokens"] == 3
    assert short_done - t0 < 5.0


def _wait_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while requests.get(url + "/get_server_info", timeout=10).json()["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "requests never started running"
        time.sleep(0.002)


def test_abort_request_by_rid(tiny_server) -> None:
    url, _ = tiny_server
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        victim = pool.submit(_post, url, "/generate", {"input_ids": [1], "rid": "victim", "return_logprob": True,
                                                       "sampling_params": {"max_new_tokens": 250, "ignore_eos": True}})
        other = pool.submit(_post, url, "/generate", {"input_ids": [2], "rid": "other",
                                                      "sampling_params": {"max_new_tokens": 250, "ignore_eos": True}})
        _wait_running(url, 2)
        # Freeze both (in_place keeps their KV), abort one, let the other finish.
        assert _post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
        aborted = _post(url, "/abort_request", {"rid": "victim"})
        assert aborted.status_code == 200 and aborted.content == b""  # SGLang answers with no body
        assert _post(url, "/continue_generation", {}).status_code == 200
        out, rest = victim.result().json(), other.result().json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 250 and len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert rest["meta_info"]["finish_reason"] == {"type": "length", "length": 250}


def test_full_queue_prefills_in_batches_not_beside_every_decode() -> None:
    """With more requests queued than slots, a finished request's slot is not refilled by
    a one-row prefill beside the next decode step: new requests wait until a quarter of
    the slots are free (``Engine._admit_now``). Without that rule this load ran a prefill
    beside nearly every decode step. A lone request still starts at once."""
    from realscale.serve.engine import Request, SamplingOptions
    from realscale.serve.server import EmbeddedServer

    server = EmbeddedServer("tiny-qwen2", max_running=8, context_length=128)
    engine, calls = server.engine, {"prefill": [], "decode": 0}
    prefill, decode = engine._prefill, engine._decode

    def counted_prefill(reqs):
        calls["prefill"].append(len(reqs))
        return prefill(reqs)

    def counted_decode(reqs):
        calls["decode"] += 1
        return decode(reqs)

    engine._prefill, engine._decode = counted_prefill, counted_decode
    try:
        lengths = [2 + (7 * i) % 13 for i in range(48)]  # staggered finishes, as sampled answers
        futures = [engine.submit(Request(rid=str(i), input_ids=[3, 4, 5 + i % 7], params=SamplingOptions(
            max_new_tokens=n, ignore_eos=True))) for i, n in enumerate(lengths)]
        done = [f.result(timeout=60) for f in futures]
        assert [len(r.output_ids) for r in done] == lengths
        assert sum(calls["prefill"]) == 48
        # every prefill after the first admits at least a quarter of the slots (2 of 8),
        # except the queue's last requests, which are fewer
        assert all(n >= 2 for n in calls["prefill"][:-1]), calls["prefill"]
        assert len(calls["prefill"]) <= 48 // 2 + 1 < calls["decode"]
        lone = engine.submit(Request(rid="lone", input_ids=[3], params=SamplingOptions(max_new_tokens=2,
                                                                                       ignore_eos=True)))
        assert len(lone.result(timeout=30).output_ids) == 2
    finally:
        server.close()


def test_same_prompt_prefilled_once_and_copies_decode_alike() -> None:
    """A group's samples of one prompt share one prefill row (the others copy its KV
    cache and logits, ``Engine._prefill``). Greedy, every copy must continue exactly as
    the same prompt prefilled alone does (a wrong or missing KV copy changes the tokens);
    sampled, the copies still draw their own tokens."""
    from realscale.serve.engine import Request, SamplingOptions
    from realscale.serve.server import EmbeddedServer

    server = EmbeddedServer("tiny-qwen2", max_running=16, context_length=128)
    engine, rows = server.engine, []
    forward = engine.runner.forward

    def counted(slot0, ids, start, last):
        rows.append(ids.shape[0])
        return forward(slot0, ids, start, last)

    engine.runner.forward = counted
    try:
        def run(prompts, temperature, n_new=12):
            futures = [engine.submit(Request(rid=f"{temperature}-{i}", input_ids=p, return_logprob=True,
                                             params=SamplingOptions(max_new_tokens=n_new, temperature=temperature,
                                                                    ignore_eos=True)))
                       for i, p in enumerate(prompts)]
            return [f.result(timeout=60) for f in futures]

        a, b = [5, 9, 2, 7, 7, 1], [4, 4, 8]
        alone = run([a], 0.0)[0]
        rows.clear()
        engine.call(lambda: engine.pause("in_place")).result(10)  # queue all six, then admit them in one step
        futures_done = []
        try:
            t = threading.Thread(target=lambda: futures_done.extend(run([a, b, a, a, b, a], 0.0)))
            t.start()
            deadline = time.monotonic() + 10
            while len(engine.waiting) < 6:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        finally:
            engine.call(engine.resume)
        t.join(60)
        assert rows[0] == 2  # six requests, two distinct prompts: two prefill rows
        got = {r.rid: r for r in futures_done}
        for rid in ("0.0-0", "0.0-2", "0.0-3", "0.0-5"):
            assert got[rid].output_ids == alone.output_ids
            assert got[rid].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert got["0.0-1"].output_ids == got["0.0-4"].output_ids
        sampled = run([a] * 8, 1.0)
        assert len({tuple(r.output_ids) for r in sampled}) > 1
    finally:
        server.close()


def test_server_start_builds_no_transformers_model_module() -> None:
    """Building a server of a default-RoPE model imports neither the family's configuration
    nor its modeling module, nor transformers' generation utilities (each costs seconds of
    start-up CPU: realscale/serve/decoder.py), nor, once an earlier process recorded the
    tokenizer's snapshot, transformers at all (realscale/models/light_tokenizer.py); it still
    reads its model type and EOS ids from config.json (``/get_model_info`` itself:
    ``test_info_health_flush``)."""
    import json
    import subprocess
    import sys

    from realscale.models.tiny import resolve_model_path
    from realscale.models.tokenizer import load_tokenizer

    path = resolve_model_path("tiny-qwen2")
    load_tokenizer(path)  # the first load goes through transformers and records its snapshot (as a run's first process)
    code = ("import json, sys\n"
            "from realscale.serve.server import EmbeddedServer\n"
            f"s = EmbeddedServer({path!r}, max_running=2, context_length=64)\n"
            "heavy = ('transformers.models.qwen2.configuration_qwen2', 'transformers.models.qwen2.modeling_qwen2',\n"
            "         'transformers.generation.utils', 'transformers.models.auto.modeling_auto', 'transformers')\n"
            "print(json.dumps([[m for m in heavy if m in sys.modules], s.hf_dict['model_type'], sorted(s.engine.eos_token_ids)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    imported, model_type, eos = json.loads(out.stdout.strip().splitlines()[-1])
    assert imported == [] and model_type == "qwen2" and eos

"""The embedded server and the client against the pinned SGLang's own source.

Every expected name here is read from the pinned SGLang's files (``sglang_reference``:
``pip download --no-deps sglang==PINNED``, nothing installed), with ``ast`` or by running
SGLang's generated JSON contract (``sglang/api/v1/api_types.py``, the decoders behind its
server's HTTP 400s). The first run fetches them (``ref.ensure_source``: what
``python scripts/fetch_sglang_source.py`` does); skipped, saying why, only when that fails.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import json
import os
import re
import time
from typing import Any

import pytest
import requests
from http_record import record_requests

from realscale.serve import protocol as P
from realscale.inference import sglang_reference as ref

SRC = ref.ensure_source()  # fetched here on a fresh machine (pip download, nothing installed)
needs_source = pytest.mark.skipif(SRC is None, reason=ref.missing_reason())

IO = "sglang/srt/managers/io_struct.py"
HTTP = "sglang/srt/entrypoints/http_server.py"
TOKENIZER = "sglang/srt/managers/tokenizer_manager.py"
SCHED_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"

# The routes an RL client uses (the begin/end session routes exist since 0.5.21).
RL_ROUTES = ["/generate", "/abort_request", "/pause_generation", "/continue_generation",
             "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group",
             "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update",
             "/update_weight_version", "/flush_cache", "/health", "/health_generate", "/ready",
             "/get_model_info", "/model_info", "/get_server_info", "/server_info"]


def _path(rel: str) -> str:
    assert SRC is not None
    return os.path.join(SRC, rel)


def _fields(cls: str, rel: str = IO) -> set[str]:
    return set(ref.class_fields(_path(rel), cls))


def _required(cls: str) -> set[str]:
    """Fields of an io_struct class without a default: what SGLang's route requires."""
    classes = {n.name: n for n in ref.parse(_path(IO)).body if isinstance(n, ast.ClassDef)}
    return {s.target.id for s in classes[cls].body if isinstance(s, ast.AnnAssign) and s.value is None}


def _literal_keys(node: ast.AST) -> set[str]:
    """String keys of every dict literal in ``node`` (a route's reply)."""
    return {k.value for d in ast.walk(node) if isinstance(d, ast.Dict)
            for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def _strings(node: ast.AST) -> set[str]:
    return {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}


def _post(url: str, path: str, body: Any = None) -> requests.Response:
    return requests.post(url + path, json=body, timeout=60)


def _wait_for(url: str, counter: str, timeout: float = 30.0) -> None:
    """Until /get_server_info's ``counter`` (num_running_reqs, num_waiting_reqs) is >= 1."""
    deadline = time.monotonic() + timeout
    while requests.get(url + "/get_server_info", timeout=10).json()[counter] < 1:
        assert time.monotonic() < deadline, f"{counter} stayed 0 for {timeout:.0f} s"
        time.sleep(0.005)


# ---------------------------------------------------------------- the pin

def test_gpu_constraints_pin_the_supported_version() -> None:
    """constraints/gpu-sglang.txt installs exactly the pinned SGLang, inside the range the
    launcher accepts; setup.py's gpu extra does not pull SGLang in (it pins its own torch)."""
    from realscale.commands.info import CONSTRAINTS, constraints

    pins = [str(r) for r in constraints(os.path.join(CONSTRAINTS, "gpu-sglang.txt")) if r.name == "sglang"]
    assert pins == [f"sglang=={ref.PINNED}"]
    assert ref.PINNED in __import__("packaging.specifiers").specifiers.SpecifierSet(ref.SUPPORTED)
    setup = os.path.join(os.path.dirname(__file__), "..", "..", "setup.py")
    reqs = [c.value for c in ast.walk(ast.parse(open(setup, encoding="utf-8").read()))
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and re.match(r"^(sglang|flash-attn)\b", c.value)]
    assert reqs == []


@needs_source
def test_pinned_version_has_what_the_range_relies_on() -> None:
    """Per-token versions, pause modes and the update session exist in the pinned source."""
    assert "weight_versions" in _fields("AbortReq")
    assert ref.class_fields(_path(IO), "PauseGenerationReqInput")["mode"] == "Literal['abort', 'retract', 'in_place']"
    routes = ref.routes(_path(HTTP))
    assert routes["/begin_weight_update"] == {"POST"} and routes["/end_weight_update"] == {"POST"}
    assert "--weight-version" in _server_options()


def _server_options() -> set[str]:
    """``--option`` of every server argument (one dataclass field each, ``_`` -> ``-``)."""
    fields_dir = _path("sglang/srt/arg_groups/fields")
    options = set()
    for name in (f for f in os.listdir(fields_dir) if f.endswith(".py")):
        path = os.path.join(fields_dir, name)
        for cls in (n for n in ref.parse(path).body if isinstance(n, ast.ClassDef)):
            options |= {"--" + f.replace("_", "-") for f in ref.class_fields(path, cls.name)}
    return options


@needs_source
def test_launcher_options_exist() -> None:
    """Every option of our launch command is a field of SGLang's server arguments."""
    from realscale.config import GenerateConfig
    from realscale.inference.sglang_launcher import sglang_command

    options = _server_options()
    gen = GenerateConfig(backend="sglang", tp=2, ep=2, pause_mode="in_place")  # a mixture of experts, replayed
    ours = {a for on_gpu in (True, False) for a in sglang_command("/m", 1, gen, on_gpu=on_gpu, routed_experts=True)
            if a.startswith("--")}
    assert {"--ep-size", "--enable-return-routed-experts"} <= ours
    assert ours <= options, sorted(ours - options)


# ---------------------------------------------------------------- request fields

@needs_source
def test_generate_fields_cover_sglangs_exactly() -> None:
    """Every GenerateReqInput field is implemented, ignored or accepted unset; no other."""
    theirs = _fields("GenerateReqInput")
    ours = P.GENERATE_FIELDS | P.GENERATE_IGNORED | P.GENERATE_UNSET_ONLY
    assert ours == theirs, {"not ours": sorted(theirs - ours), "not SGLang's": sorted(ours - theirs)}
    assert not (P.GENERATE_FIELDS & P.GENERATE_UNSET_ONLY) and not (P.GENERATE_IGNORED & P.GENERATE_UNSET_ONLY)
    # the contract gate knows no field GenerateReqInput lacks
    assert set(ref.api_types().GenerateRequest.__struct_fields__) <= theirs


@needs_source
def test_unset_only_fields_default_to_unset() -> None:
    """A client that leaves a feature field at SGLang's default is always accepted."""
    cls = next(n for n in ref.parse(_path(IO)).body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and stmt.target.id in P.GENERATE_UNSET_ONLY:
            value = stmt.value
            if isinstance(value, ast.Call):  # field(default=...)
                value = next(k.value for k in value.keywords if k.arg == "default")
            assert P.is_unset(ast.literal_eval(value)), stmt.target.id


@needs_source
def test_sampling_fields_are_the_contracts() -> None:
    """sampling_params: exactly the keys SGLang's contract admits, our defaults = its defaults."""
    api = ref.api_types()
    theirs = set(api._FIELDS_SamplingParams)
    ours = P.SAMPLING_FIELDS | set(P.SAMPLING_DEFAULT_ONLY)
    assert ours == theirs, {"not ours": sorted(theirs - ours), "not SGLang's": sorted(ours - theirs)}
    defaults = api.SamplingParams()
    for key, default in P.SAMPLING_DEFAULT_ONLY.items():
        theirs_default = getattr(defaults, key)
        assert theirs_default == default or (default is None and P.is_unset(theirs_default)), key


CONTROL = [(P.PAUSE_FIELDS, "PauseGenerationReqInput"), (P.CONTINUE_FIELDS, "ContinueGenerationReqInput"),
           (P.ABORT_FIELDS, "AbortReq"), (P.DISK_FIELDS, "UpdateWeightFromDiskReqInput"),
           (P.INIT_GROUP_FIELDS, "InitWeightsUpdateGroupReqInput"),
           (P.DESTROY_GROUP_FIELDS, "DestroyWeightsUpdateGroupReqInput"),
           (P.DIST_FIELDS, "UpdateWeightsFromDistributedReqInput"), (P.BEGIN_FIELDS, "BeginWeightUpdateReqInput"),
           (P.END_FIELDS, "EndWeightUpdateReqInput"), (P.VERSION_FIELDS, "UpdateWeightVersionReqInput")]


@needs_source
@pytest.mark.parametrize("ours, cls", CONTROL, ids=[c for _, c in CONTROL])
def test_control_fields_are_sglangs(ours: set[str], cls: str) -> None:
    theirs = _fields(cls)
    assert ours == theirs, {"not ours": sorted(theirs - ours), "not SGLang's": sorted(ours - theirs)}


REQUIRED = {"/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
            "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
            "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
            "/update_weight_version": "UpdateWeightVersionReqInput"}


@needs_source
def test_required_fields_are_required(tiny_server) -> None:
    """A body without a field SGLang requires gets 400 naming it; the others are optional."""
    url, _ = tiny_server
    full = {"model_path": "/nonexistent", "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
            "world_size": 2, "names": [], "dtypes": [], "shapes": [], "new_version": "1"}
    for path, cls in REQUIRED.items():
        need = _required(cls)
        assert need, cls
        for field in need:
            body = {k: v for k, v in full.items() if k in _fields(cls) and k != field}
            r = _post(url, path, body)
            assert r.status_code == 400 and field in r.json()["error"], (path, field, r.text)


# ---------------------------------------------------------------- routes

@needs_source
def test_rl_routes_are_sglangs(tiny_server) -> None:
    """Each route an RL client uses exists in SGLang and here, with SGLang's methods."""
    _, server = tiny_server
    theirs = ref.routes(_path(HTTP))
    ours: dict[str, set[str]] = {}
    for route in server.app().router.routes():
        ours.setdefault(route.resource.canonical, set()).add(route.method)
    for path in RL_ROUTES:
        assert path in theirs, f"{path} is not a route of SGLang {ref.PINNED}"
        assert ours.get(path, set()) - {"HEAD"} == theirs[path], (path, ours.get(path), theirs[path])


# ---------------------------------------------------------------- response shapes

META_CONDITIONAL = {  # meta_info keys SGLang writes only for features the embedded server refuses
    "audio_tokens", "image_tokens", "video_tokens",  # multimodal inputs
    "cached_tokens_details",  # hierarchical cache breakdown
    "dp_rank",  # data-parallel attention
    "hidden_states", "routed_experts", "indexer_topk",  # return_hidden_states / _routed_experts / _indexer_topk
    "output_token_sampling_logprobs", "output_token_sampling_mask", "output_token_sampling_mask_length",
    "input_top_logprobs", "output_top_logprobs",  # top_logprobs_num > 0
    "input_token_ids_logprobs", "output_token_ids_logprobs",  # token_ids_logprob
}


def _expected_meta_keys() -> set[str]:
    tm = _path(TOKENIZER)
    keys = ref.dict_keys(ref.function(tm, "_handle_batch_output", "TokenizerManager"), "meta_info")
    keys |= ref.dict_keys(ref.function(tm, "add_logprob_to_meta_info", "TokenizerManager"), "meta_info")
    keys |= ref.dict_keys(ref.function(_path("sglang/srt/utils/weight_versions.py"),
                                       "add_weight_versions_to_meta_info"), "meta_info")
    assert META_CONDITIONAL <= keys, sorted(META_CONDITIONAL - keys)  # the exclusions are still SGLang's
    return keys - META_CONDITIONAL


@needs_source
def test_generate_reply_is_sglangs(tiny_server) -> None:
    """/generate answers with the meta_info keys SGLang's tokenizer manager writes, and the
    reply passes SGLang's own response decoder."""
    url, _ = tiny_server
    r = _post(url, "/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "return_text_in_logprobs": True,
                                 "return_prompt_token_ids": True, "sampling_params": {"max_new_tokens": 5}})
    assert r.status_code == 200
    reply = r.json()
    api = ref.api_types()
    decoded = api.GenerateResponse.from_json_value(reply)
    assert decoded.prompt_token_ids == [5, 6, 7] and decoded.output_ids == reply["output_ids"]
    missing = _expected_meta_keys() - set(reply["meta_info"])
    assert not missing, sorted(missing)
    assert all(isinstance(e[2], str) for e in reply["meta_info"]["output_token_logprobs"])
    assert reply["meta_info"]["input_token_logprobs"] == []  # logprob_start_len = -1: output tokens only


@needs_source
def test_abort_reasons_are_sglangs(tiny_server) -> None:
    """A running request's abort carries FINISH_ABORT.to_json()'s keys; a waiting one's the
    tokenizer manager's waiting-queue shape and message."""
    url, _ = tiny_server
    sched = ref.parse(_path("sglang/srt/managers/schedule_batch.py"))
    finish_abort = next(n for n in sched.body if isinstance(n, ast.ClassDef) and n.name == "FINISH_ABORT")
    to_json = next(n for n in finish_abort.body if isinstance(n, ast.FunctionDef) and n.name == "to_json")
    running_keys = {k.value for r in ast.walk(to_json) if isinstance(r, ast.Return) for k in r.value.keys}
    default_message = next(c.value for c in ast.walk(finish_abort.body[0]) if isinstance(c, ast.Constant)
                           and isinstance(c.value, str))
    handler = ref.function(_path(TOKENIZER), "_handle_abort_req", "TokenizerManager")
    waiting_keys = ref.dict_keys(handler, "finish_reason")
    assert P.waiting_abort()["message"] in _strings(handler)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(_post, url, "/generate", {"input_ids": [1], "rid": "run-1", "sampling_params": {
            "max_new_tokens": 250, "ignore_eos": True}})
        _wait_for(url, "num_running_reqs")
        assert _post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
        waiting = pool.submit(_post, url, "/generate", {"input_ids": [2], "rid": "wait-1"})
        _wait_for(url, "num_waiting_reqs")
        for rid in ("run-1", "wait-1"):
            assert _post(url, "/abort_request", {"rid": rid}).status_code == 200
        assert _post(url, "/continue_generation", {}).status_code == 200
        ran, waited = running.result().json(), waiting.result().json()
    reason = ran["meta_info"]["finish_reason"]
    assert set(reason) == running_keys and reason["type"] == "abort" and reason["message"] == default_message
    reason = waited["meta_info"]["finish_reason"]
    assert set(reason) == waiting_keys and reason["message"] == P.waiting_abort()["message"]
    assert waited["output_ids"] == []
    api = ref.api_types()
    for reply in (ran, waited):
        api.GenerateResponse.from_json_value(reply)


@needs_source
def test_info_routes_are_sglangs(tiny_server) -> None:
    """/get_model_info has every key SGLang's model_info() writes (embedding models aside);
    both info replies pass SGLang's decoders, /get_server_info carries the contract's keys."""
    url, _ = tiny_server
    api = ref.api_types()
    expected = ref.dict_keys(ref.function(_path(HTTP), "model_info"), "result") - {"embedding"}
    for path in ("/get_model_info", "/model_info"):
        info = requests.get(url + path, timeout=10).json()
        assert expected <= set(info), sorted(expected - set(info))
        api.GetModelInfoResponse.from_json_value(info)
    for path in ("/get_server_info", "/server_info"):
        info = requests.get(url + path, timeout=10).json()
        decoded = api.GetServerInfoResponse.from_json_value(info)
        missing = set(api.GetServerInfoResponse.__struct_fields__) - {"deployment_info", "host", "port"} - set(info)
        assert not missing, sorted(missing)
        assert decoded.version == ref.PINNED and info["tp_size"] == 1


@needs_source
def test_control_replies_are_sglangs(tiny_server, tmp_path) -> None:
    """Bodies and status codes of the control routes, as http_server.py builds them."""
    url, server = tiny_server
    http = _path(HTTP)
    for path, fn in [("/pause_generation", "pause_generation"), ("/continue_generation", "continue_generation")]:
        want = {k.value: v.value for node in ast.walk(ref.function(http, fn)) if isinstance(node, ast.Dict)
                for k, v in zip(node.keys, node.values)}
        assert _post(url, path, {}).json() == want
    disk = _post(url, "/update_weights_from_disk", {"model_path": server.model_path, "weight_version": "0"})
    assert disk.status_code == 200
    assert _literal_keys(ref.function(http, "update_weights_from_disk")) <= set(disk.json())
    # the update session: SGLang's refusals, word for word
    updater = ref.parse(_path(SCHED_UPDATER))
    cls = next(n for n in updater.body if isinstance(n, ast.ClassDef) and n.name == "SchedulerWeightUpdaterManager")
    texts = {n.name: _strings(n) for n in cls.body if isinstance(n, ast.FunctionDef)}
    session_keys = _literal_keys(ref.function(http, "begin_weight_update"))
    assert session_keys == _literal_keys(ref.function(http, "end_weight_update")) == {"success", "message"}
    refused = _post(url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})
    assert refused.status_code == 400 and refused.json()["message"] in texts["update_weights_from_distributed"]
    assert _post(url, "/end_weight_update", {}).json()["message"] in texts["end_weight_update"]
    begun = _post(url, "/begin_weight_update", {})
    assert begun.status_code == 200 and session_keys <= set(begun.json()) and begun.json()["success"] is True
    again = _post(url, "/begin_weight_update", {"selector": "all"})
    assert again.status_code == 400 and again.json()["message"] in texts["begin_weight_update"]
    assert _post(url, "/end_weight_update", {}).status_code == 200
    version = _post(url, "/update_weight_version", {"new_version": "0", "abort_all_requests": False}).json()
    assert _literal_keys(ref.function(http, "update_weight_version")) >= set(version)
    assert version == {"success": True, "message": "Weight version updated to 0", "new_version": "0"}
    # flush refused while requests hold KV fails an update, with SGLang's message
    flush_texts = texts["flush_cache_after_weight_update"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(_post, url, "/generate", {"input_ids": [3], "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True}})
        _wait_for(url, "num_running_reqs")
        assert _post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
        kept = _post(url, "/update_weights_from_disk", {"model_path": server.model_path})
        assert kept.status_code == 400 and kept.json()["message"] in flush_texts
        assert _post(url, "/update_weights_from_disk", {"model_path": server.model_path,
                                                        "flush_cache": False}).status_code == 200
        assert requests.post(url + "/flush_cache", timeout=10).status_code == 400
        assert _post(url, "/continue_generation", {}).status_code == 200
        assert job.result().json()["meta_info"]["completion_tokens"] == 200
    assert requests.get(url + "/flush_cache", timeout=10).status_code == 200


@needs_source
def test_lax_control_bodies(tiny_server) -> None:
    """As SGLang's pydantic parsing: unknown keys ignored, integer strings are integers."""
    url, _ = tiny_server
    assert _post(url, "/continue_generation", {"unknown": 1}).status_code == 200
    r = _post(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "1",
                                                  "rank_offset": "3", "world_size": "2", "pp_rank": 0})
    assert r.status_code == 400 and "rank_offset" in r.json()["error"]  # parsed as 3, out of range for 2


# ---------------------------------------------------------------- the generate contract

ACCEPTED_BODIES = [  # what SGLang's contract admits: the embedded server serves these
    {"input_ids": [1, 2], "image_data": None, "stream": False, "return_logprob": True},
    {"input_ids": [1, 2], "sampling_params": {"top_k": 1 << 30, "min_p": 0.0, "logit_bias": {}, "n": 1}},
    {"input_ids": [[1], [2]], "rid": "batch", "return_logprob": [True, False],
     "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]},
    {"text": "ab", "log_metrics": False, "priority": 3, "custom_labels": {"a": "b"}, "not_a_field": 1},
]


@needs_source
@pytest.mark.parametrize("body", ACCEPTED_BODIES)
def test_contract_bodies_are_served(tiny_server, body) -> None:
    ref.api_types().GenerateRequest.from_json_value(body)  # SGLang admits it
    url, _ = tiny_server
    r = _post(url, "/generate", body)
    assert r.status_code == 200, r.text
    replies = r.json() if isinstance(r.json(), list) else [r.json()]
    for reply in replies:
        ref.api_types().GenerateResponse.from_json_value(reply)
    if body.get("rid") == "batch":
        assert [x["meta_info"]["id"] for x in replies] == ["batch_0", "batch_1"]
        assert "output_token_logprobs" in replies[0]["meta_info"]
        assert "output_token_logprobs" not in replies[1]["meta_info"]
        assert [len(x["output_ids"]) for x in replies] == [2, 3]


@needs_source
@pytest.mark.parametrize("body", [
    {"input_ids": [1], "sampling_params": {"bogus": 1}},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}},
    {"input_ids": "abc"},
])
def test_contract_refusals_are_refused(tiny_server, body) -> None:
    """What SGLang's contract refuses, the embedded server refuses too (HTTP 400)."""
    api = ref.api_types()
    with pytest.raises(api.JsonContractError):
        api.GenerateRequest.from_json_value(body)
    url, _ = tiny_server
    assert _post(url, "/generate", body).status_code == 400


@needs_source
def test_streaming_is_sglangs(tiny_server) -> None:
    """stream: true answers text/event-stream ``data: {...}`` chunks and ``data: [DONE]``,
    the byte framing of SGLang's serve_generate_request; chunks are cumulative."""
    framing = ref.function(_path(HTTP), "serve_generate_request")
    consts = {c.value for c in ast.walk(framing) if isinstance(c, ast.Constant) and isinstance(c.value, bytes)}
    assert {b"data: ", b"\n\n", b"data: [DONE]\n\n"} <= consts
    url, _ = tiny_server
    r = requests.post(url + "/generate", json={"input_ids": [4, 5], "stream": True, "return_logprob": True,
                                               "sampling_params": {"max_new_tokens": 6, "ignore_eos": True,
                                                                   "stream_interval": 2}}, stream=True, timeout=60)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    raw = r.content
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    api = ref.api_types()
    for c in chunks:
        api.GenerateResponse.from_json_value(c)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    assert all(chunks[-1]["output_ids"][:n] == c["output_ids"] for c, n in zip(chunks, lengths))


# ---------------------------------------------------------------- what our client sends

@needs_source
def test_client_bodies_fit_sglang(tmp_path) -> None:
    """Every request our client sends fits the pinned SGLang: known route and method, the
    fields of its request class (required ones present), /generate admitted by its contract."""
    from realscale.inference.client import InferenceClient
    from realscale.serve.server import EmbeddedServer, start_in_thread
    from realscale.inference.weight_sync import WeightSender, bucket_meta

    classes = {"/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
               "/update_weights_from_disk": "UpdateWeightFromDiskReqInput"}
    server = EmbeddedServer("tiny-qwen2", max_running=4, context_length=128)
    seen = record_requests(server)
    url, stop = start_in_thread(server)
    try:
        async def run() -> None:
            async with InferenceClient([url]) as client:
                task = asyncio.create_task(client.generate([5, 6], {"max_new_tokens": 40, "ignore_eos": True}))
                await asyncio.sleep(0.05)
                await client.pause("abort")
                await client.update_weights_from_disk(server.model_path, weight_version=1, flush_cache=True)
                await client.resume()
                await task
                await client.health()

        asyncio.run(run())
    finally:
        stop()
    theirs = ref.routes(_path(HTTP))
    api = ref.api_types()
    assert {p for _, p, _ in seen} >= {"/generate", "/pause_generation", "/continue_generation",
                                       "/update_weights_from_disk", "/health"}
    for method, path, body in seen:
        assert method in theirs[path], (method, path)
        if path == "/generate":
            api.GenerateRequest.from_json_value(body)
        elif path in classes:
            assert set(body) <= _fields(classes[path]) and _required(classes[path]) <= set(body), (path, body)
    # the weight-group bodies (sent for real in test_weight_sync / test_sglang_weight_group)
    sender = WeightSender("127.0.0.1", 1, world_size=4, group_name="g")
    init = sender.init_request(2)
    assert set(init) <= _fields("InitWeightsUpdateGroupReqInput") and _required("InitWeightsUpdateGroupReqInput") <= set(init)
    import torch

    dist = {**bucket_meta([("w", torch.zeros(2, 3, dtype=torch.bfloat16))]), "group_name": "g",
            "flush_cache": False, "weight_version": "3"}
    assert set(dist) <= _fields("UpdateWeightsFromDistributedReqInput")
    assert dist["dtypes"] == ["bfloat16"] and dist["shapes"] == [[2, 3]]

"""An embedded server with two tensor-parallel ranks (two processes, gloo): the same
tokens and log-probs as one rank, pause/resume/abort, collective RPC, SGLang's weight
update into both ranks (checked against shards packed from the full tensors), and a
dead rank that makes the server unhealthy."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
import torch

from realscale.serve.ranks import RankCallError
from realscale.parallel.net import free_port

pytestmark = pytest.mark.multiproc

PROMPTS = [[3, 4, 5], list(range(10, 40)), [7, 8], [100, 3, 9, 12]]
LENGTHS = [30, 12, 24, 6]  # different lengths: requests leave mid-batch and slots move


@pytest.fixture(scope="module")
def tp2_server(tmp_path_factory):
    """``realscale serve --tp 2`` (rank 0 and one spawned rank); yields (url, process, log path)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("tp2") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "realscale", "serve", "--model", "tiny-qwen2", "--tp", "2",
                                 "--port", str(port), "--context-length", "256", "--max-running", "16"],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.2)
        yield url, proc, log_path
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _post(url: str, path: str, body=None) -> requests.Response:
    return requests.post(url + path, json=body, timeout=120)


def _greedy(url: str, prompts=PROMPTS, lengths=LENGTHS, rids=None) -> list[dict]:
    rids = rids or [None] * len(prompts)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: one batch
        return list(pool.map(lambda a: _post(url, "/generate", {
            "input_ids": a[0], "return_logprob": True, **({"rid": a[2]} if a[2] else {}),
            "sampling_params": {"max_new_tokens": a[1], "temperature": 0, "ignore_eos": True}}).json(),
            zip(prompts, lengths, rids)))


def _logprobs(reply: dict) -> list[float]:
    return [e[0] for e in reply["meta_info"]["output_token_logprobs"]]


def _wait_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while requests.get(url + "/get_server_info", timeout=10).json()["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "requests never started running"
        time.sleep(0.005)


def test_tp2_generates_what_tp1_generates(tp2_server, tiny_server) -> None:
    (url2, *_), (url1, _) = tp2_server, tiny_server
    assert requests.get(url2 + "/get_server_info", timeout=10).json()["tp_size"] == 2
    assert requests.get(url1 + "/get_server_info", timeout=10).json()["tp_size"] == 1
    one, two = _greedy(url1), _greedy(url2)
    for a, b, n in zip(one, two, LENGTHS):
        assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == n
        assert max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b))) < 1e-4


def test_pause_resume_and_abort(tp2_server, tiny_server) -> None:
    url = tp2_server[0]
    reference = _greedy(tiny_server[0], PROMPTS[:2], [120, 120])[0]["output_ids"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # retract: the request leaves its slot, is prefilled again on continue, and carries on
        keep = pool.submit(_greedy, url, PROMPTS[:2], [120, 120], ["keep", "victim"])
        _wait_running(url, 2)
        assert _post(url, "/pause_generation", {"mode": "retract"}).status_code == 200
        assert _post(url, "/abort_request", {"rid": "victim"}).status_code == 200
        assert _post(url, "/continue_generation", {}).status_code == 200
        kept, victim = keep.result()
    assert victim["meta_info"]["finish_reason"]["type"] == "abort"
    assert kept["output_ids"] == reference and kept["meta_info"]["num_retractions"] == 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # abort: answered at once with partial output
        cut = pool.submit(_greedy, url, PROMPTS[:1], [240])
        _wait_running(url, 1)
        assert _post(url, "/pause_generation", {"mode": "abort"}).status_code == 200
        (partial,) = cut.result()
        assert _post(url, "/continue_generation", {}).status_code == 200
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    assert partial["output_ids"] == reference[:len(partial["output_ids"])]
    assert _greedy(url, PROMPTS[:1], [5])[0]["output_ids"] == reference[:5]  # serving again


def test_call_all_runs_on_every_rank(tiny_server, tp2_server, tmp_path) -> None:
    _, server = tiny_server  # in-process: a "module:function" target, called on the scheduler thread
    out = server.engine.call(lambda: server.ranks.call_all("decoder_cases:rank_info", "hi")).result(60)
    assert out == [{"tag": "hi", "rank": 0, "pid": os.getpid(), "numel": server.ranks.worker.weights.flat.numel()}]
    with pytest.raises(RankCallError, match=r"no_such_method: rank 0: AttributeError"):
        server.engine.call(lambda: server.ranks.call_all("no_such_method")).result(60)
    # over HTTP on two ranks: each rank's error comes back, named
    url = tp2_server[0]
    r = _post(url, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert r.status_code == 400
    assert "rank 0: ValueError" in r.json()["message"] and "rank 1: ValueError" in r.json()["message"]
    assert _healthy(url)


def test_sglang_weight_update_reaches_both_ranks(tp2_server, tmp_path) -> None:
    """A sender joins the tp=2 server at rank_offset 1 (world 3) and broadcasts full HF
    tensors in small buckets; each rank keeps its shard, exactly as pack_shard cuts it."""
    from transformers import AutoModelForCausalLM

    from realscale.inference.client import InferenceClient
    from realscale.inference.weight_sync import WeightSender, split_buckets
    from realscale.serve.weights import (full_megatron_tensors, model_spec, read_hf_config, server_layout,
                                            tensor_hashes)
    from realscale.models.tiny import build_tiny_model
    from realscale.parallel.reshard import shard_index
    from realscale.parallel.reshard_exec import pack_shard

    url = tp2_server[0]
    new_dir = build_tiny_model(str(tmp_path / "v3"), family="qwen2", seed=3)
    state = AutoModelForCausalLM.from_pretrained(new_dir).state_dict()
    sender = WeightSender("127.0.0.1", free_port(), world_size=3, backend="gloo")

    async def push() -> int:
        async with InferenceClient([url]) as client:
            await client.init_weights_update_group(sender)
            await client.pause("abort")
            sent = await client.update_weights(sender, split_buckets(iter(state.items()), 16 * 1024),
                                               weight_version=3)
            await client.resume()
            return sent

    try:
        assert asyncio.run(push()) > 0
    finally:
        sender.close()  # frees the group's name in this process (torch keeps one registry)
    hashes = requests.get(url + "/realscale/weight_hashes", timeout=60).json()
    assert hashes["tp_size"] == 2 and hashes["weight_version"] == "3"
    spec, arch = model_spec(read_hf_config(new_dir), 2, torch.float32)
    full = full_megatron_tensors(state.items(), spec, arch)
    for rank in (0, 1):
        index = shard_index(spec, server_layout(2), rank)
        expected = pack_shard(spec, server_layout(2), rank, full)
        assert hashes["ranks"][rank] == tensor_hashes(spec, index, expected), rank
    assert hashes["ranks"][0] != hashes["ranks"][1]
    reply = _greedy(url, PROMPTS[:1], [8])[0]
    assert reply["meta_info"]["weight_versions"] == [{"version": "3", "start": 0, "end": 8}]
    model = AutoModelForCausalLM.from_pretrained(new_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0] + reply["output_ids"]])).logits[0, len(PROMPTS[0]) - 1:-1]
    assert reply["output_ids"] == logits.argmax(-1).tolist()
    # back to the original weights from disk: every rank loads its shard
    original = requests.get(url + "/get_model_info", timeout=10).json()["model_path"]
    disk = _post(url, "/update_weights_from_disk", {"model_path": original, "weight_version": "4"}).json()
    assert disk["success"], disk
    after = requests.get(url + "/realscale/weight_hashes", timeout=60).json()["ranks"]
    assert after[0] != hashes["ranks"][0] and after[1] != hashes["ranks"][1]


def test_dead_rank_makes_server_unhealthy_and_exit(tp2_server) -> None:
    """Last in this module: it ends the module's server."""
    url, proc, log_path = tp2_server
    pids = requests.get(url + "/get_server_info", timeout=10).json()["realscale_rank_pids"]
    assert len(pids) == 2 and pids[0] == proc.pid
    os.kill(pids[1], signal.SIGKILL)
    statuses: list = []
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            statuses.append(requests.get(url + "/health", timeout=2).status_code)
        except requests.RequestException:
            statuses.append("refused")
        time.sleep(0.05)
    code = proc.wait(timeout=30)
    text = log_path.read_text()
    assert code == 1, text
    failed = [i for i, s in enumerate(statuses) if s != 200]
    assert failed and all(s in (503, "refused") for s in statuses[failed[0]:]), statuses  # never healthy again
    assert f"rank 1 (pid {pids[1]}) exited with code -9; the server is unhealthy and exits" in text

"""SGLang launcher: the command line everywhere; a real launch only on a GPU with SGLang."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from realscale.config import GenerateConfig
from realscale.inference.sglang_launcher import SGLangVersionError, check_sglang_version, launch_sglang, sglang_command
from realscale.inference.sglang_reference import PINNED, SUPPORTED


def test_command_line() -> None:
    cmd = sglang_command("/m", 30001, tp=2, context_length=4096, max_running_requests=64,
                         mem_fraction_static=0.7, weight_version="3")
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    args = [a for a in cmd[3:] if a != "--skip-server-warmup"]  # the one flag without a value
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--model-path"] == "/m" and pairs["--port"] == "30001" and pairs["--tp-size"] == "2"
    assert pairs["--context-length"] == "4096" and pairs["--max-running-requests"] == "64"
    assert pairs["--mem-fraction-static"] == "0.7" and pairs["--weight-version"] == "3"
    assert pairs["--host"] == "127.0.0.1" and "--skip-server-warmup" in cmd


@pytest.mark.parametrize("version, ok", [(PINNED, True), ("0.5.21", True), ("0.5.23.post1", True),
                                         ("0.5.20", False), ("0.5.10.post1", False), ("0.5.24", False),
                                         ("0.6.0", False), ("not-a-version", False)])
def test_version_range(version: str, ok: bool) -> None:
    """The installed SGLang must lie in SUPPORTED; otherwise one line says so and how to fix it."""
    if ok:
        assert check_sglang_version(version) == version
        return
    with pytest.raises(SGLangVersionError) as err:
        check_sglang_version(version)
    message = str(err.value)
    assert "\n" not in message and version in message and SUPPORTED in message


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_missing_sglang_is_refused_before_anything_starts(tmp_path) -> None:
    with pytest.raises(SGLangVersionError, match="not installed"):
        launch_sglang(GenerateConfig(), "/nonexistent", [[0]], str(tmp_path))
    assert not list(tmp_path.iterdir())  # no log file: nothing was started


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_client_against_real_sglang(tmp_path) -> None:
    """Not run on the CPU development machine (no CUDA, no SGLang)."""
    from realscale.inference.client import InferenceClient
    from realscale.models.tiny import resolve_model_path

    path = resolve_model_path("small-qwen2")
    servers = launch_sglang(GenerateConfig(), path, [[0]], str(tmp_path))
    try:
        async def main():
            async with InferenceClient([url for url, _ in servers]) as client:
                task = asyncio.create_task(client.generate([5, 6, 7], {"max_new_tokens": 64, "ignore_eos": True}))
                await asyncio.sleep(0.2)
                await client.pause("abort")
                await client.update_weights_from_disk(path, weight_version=1)
                await client.resume()
                return await task
        res = asyncio.run(main())
        assert len(res.output_ids) == 64 == len(res.output_logprobs) == len(res.output_versions)
    finally:
        for _, proc in servers:
            proc.kill()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_train_with_sglang_backend_refused_before_anything_starts(tmp_path, capsys) -> None:
    """``realscale train generate.backend=sglang`` without a supported SGLang: one line, exit 1,
    no model prepared, no process started."""
    from realscale.config import load_config
    from realscale.launcher.supervisor import train

    cfg = load_config(None, ["generate.backend=sglang", f"run.output_dir={tmp_path}", "run.name=r"])
    assert train(cfg, rank_entry=None) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "SGLang is not installed" in out[0]
    assert not (tmp_path / "r" / "logs").exists() and not (tmp_path / "r" / "config.yaml").exists()


def _nccl_trainer(model_dir: str, url: str, port: int, conn) -> None:
    """GPU 1: our sender streams the model's weights into the SGLang server on GPU 0."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from realscale.inference.client import InferenceClient
        from realscale.inference.weight_sync import WeightSender, split_buckets

        torch.cuda.set_device(1)
        state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        sender = WeightSender("127.0.0.1", port, world_size=2, backend="nccl", device="cuda:1")

        async def push() -> int:
            async with InferenceClient([url]) as client:
                await client.init_weights_update_group(sender)  # asks /get_server_info for tp_size
                await client.pause("abort")
                sent = await client.update_weights(sender, split_buckets(state.items(), 1 << 20), weight_version=5)
                await client.resume()
                return sent

        conn.send(("ok", asyncio.run(push())))
    except BaseException as exc:  # noqa: BLE001 - report to the test
        conn.send(("error", repr(exc)))


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_distributed_update_into_real_sglang(tmp_path) -> None:
    """Not run on the CPU development machine: two GPUs, SGLang on GPU 0, the sender on GPU 1
    (NCCL). The pinned protocol end to end: group join, begin / buckets / end, version 5."""
    import multiprocessing as mp

    import requests
    import torch

    from realscale.models.tiny import resolve_model_path
    from realscale.parallel.net import free_port

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (one per NCCL rank)")
    path = resolve_model_path("small-qwen2")
    (url, server), = launch_sglang(GenerateConfig(), path, [[0]], str(tmp_path))
    try:
        parent, child = mp.get_context("spawn").Pipe(duplex=False)
        proc = mp.get_context("spawn").Process(target=_nccl_trainer, args=(path, url, free_port(), child))
        proc.start()
        assert parent.poll(600), "trainer did not finish"
        status, sent = parent.recv()
        proc.join(30)
        assert status == "ok", sent
        reply = requests.post(url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 8, "ignore_eos": True}}, timeout=120).json()
        assert reply["meta_info"]["weight_version"] == "5"
    finally:
        server.kill()


def test_a_pause_that_keeps_requests_turns_the_prefix_cache_off() -> None:
    """SGLang 0.5.23 refuses the cache flush of an update made while requests wait
    (retract / in_place) and keeps the old weights' prefix KV; its prefix cache must be off
    then. After an abort pause nothing runs, the flush succeeds, and the cache may stay."""
    assert "--disable-radix-cache" not in sglang_command("/m", 30001)
    assert "--disable-radix-cache" not in sglang_command("/m", 30001, pause_mode="abort")
    for mode in ("retract", "in_place"):
        assert "--disable-radix-cache" in sglang_command("/m", 30001, pause_mode=mode)


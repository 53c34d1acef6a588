"""SGLang launcher: the command line everywhere; a real launch only on a GPU with SGLang."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from realscale.config import GenerateConfig
from realscale.inference.sglang_launcher import (CPU_FLAGS, SGLangVersionError, check_sglang_version, cpu_bind,
                                                 sglang_command, sglang_env)
from realscale.inference.sglang_reference import PINNED, SUPPORTED


_SWITCHES = {"--skip-server-warmup", "--disable-cuda-graph", "--sleep-on-idle", "--disable-radix-cache"}


def _pairs(cmd: list[str]) -> dict[str, str]:
    args = [a for a in cmd[3:] if a not in _SWITCHES]  # the flags without a value
    return dict(zip(args[::2], args[1::2]))


def test_command_line() -> None:
    gen = GenerateConfig(backend="sglang", tp=2, context_length=4096, max_running_requests=64, mem_fraction_static=0.7)
    cmd = sglang_command("/m", 30001, gen, weight_version="3", dtype="bfloat16")
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    pairs = _pairs(cmd)
    assert pairs["--model-path"] == "/m" and pairs["--port"] == "30001" and pairs["--tp-size"] == "2"
    assert pairs["--context-length"] == "4096" and pairs["--max-running-requests"] == "64"
    assert pairs["--mem-fraction-static"] == "0.7" and pairs["--weight-version"] == "3"
    assert pairs["--host"] == "127.0.0.1" and pairs["--dtype"] == "bfloat16" and "--skip-server-warmup" in cmd
    assert "--device" not in pairs
    assert sglang_env(gen, on_gpu=True, base={"A": "1"}) == {"A": "1", "SGLANG_TIMEOUT_KEEP_ALIVE": "3600"}


def test_cpu_command_line_and_environment() -> None:
    """SGLang-on-CPU (module docstring of the launcher): the CPU engine's backends, a KV
    pool of every running request at full context within 5% of the memory, and, with two
    ranks, each rank's cores (SGLang asserts one NUMA node per rank otherwise)."""
    gen = GenerateConfig(backend="sglang", tp=2, context_length=512, max_running_requests=8, cpu_threads=1)
    cmd = sglang_command("/m", 30001, gen, dtype="float32", on_gpu=False)
    pairs = _pairs(cmd)
    assert pairs["--device"] == "cpu" and pairs["--attention-backend"] == "torch_native"
    assert pairs["--sampling-backend"] == "pytorch" and pairs["--grammar-backend"] == "none"
    assert pairs["--mem-fraction-static"] == "0.05" and pairs["--max-total-tokens"] == str(8 * 512)
    assert all(flag in cmd for flag in CPU_FLAGS)
    env = sglang_env(gen, on_gpu=False, base={})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in sglang_env(GenerateConfig(backend="sglang"), on_gpu=False, base={})
    assert sglang_env(gen, on_gpu=False, base={"SGLANG_CPU_OMP_THREADS_BIND": "5|6"})["SGLANG_CPU_OMP_THREADS_BIND"] == "5|6"


@pytest.mark.parametrize("ranks, threads, cpus, want", [(2, 1, [0, 1], "0|1"), (2, 4, list(range(8)), "0-3|4-7"),
                                                         (2, 2, [0, 1], "0-1|0-1"), (3, 1, [4, 6], "4|6|4"),
                                                         (1, 3, [0, 1, 2, 5], "0-2")])
def test_cpu_bind(ranks: int, threads: int, cpus: list[int], want: str) -> None:
    assert cpu_bind(ranks, threads, cpus) == want


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
    from realscale.errors import LaunchError
    from realscale.launcher.local import start_engine_servers

    with pytest.raises(LaunchError, match="not installed.*scripts/sglang_cpu/install.sh"):
        start_engine_servers("/nonexistent", GenerateConfig(backend="sglang"), str(tmp_path))
    assert not list(tmp_path.iterdir())  # no log file: nothing was started


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_client_against_real_sglang(tmp_path) -> None:
    """Not run on the CPU development machine (no CUDA, no SGLang)."""
    from realscale.inference.client import InferenceClient
    from realscale.models.tiny import resolve_model_path

    from realscale.launcher.local import start_engine_servers, stop_servers

    path = resolve_model_path("small-qwen2")
    servers = start_engine_servers(path, GenerateConfig(backend="sglang"), str(tmp_path), dtype="bfloat16", first_gpu=0)
    try:
        async def main():
            async with InferenceClient([s.url for s in servers]) as client:
                task = asyncio.create_task(client.generate([5, 6, 7], {"max_new_tokens": 64, "ignore_eos": True}))
                await asyncio.sleep(0.2)
                await client.pause("abort")
                await client.update_weights_from_disk(path, weight_version=1)
                await client.resume()
                return await task
        res = asyncio.run(main())
        assert len(res.output_ids) == 64 == len(res.output_logprobs) == len(res.output_versions)
    finally:
        stop_servers(servers)


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
    from realscale.launcher.local import start_engine_servers, stop_servers

    path = resolve_model_path("small-qwen2")
    servers = start_engine_servers(path, GenerateConfig(backend="sglang"), str(tmp_path), dtype="bfloat16", first_gpu=0)
    url = servers[0].url
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
        stop_servers(servers)


def test_a_pause_that_keeps_requests_turns_the_prefix_cache_off() -> None:
    """SGLang 0.5.23 refuses the cache flush of an update made while requests wait
    (retract / in_place) and keeps the old weights' prefix KV; its prefix cache must be off
    then. After an abort pause nothing runs, the flush succeeds, and the cache may stay."""
    assert "--disable-radix-cache" not in sglang_command("/m", 30001, GenerateConfig())
    assert "--disable-radix-cache" not in sglang_command("/m", 30001, GenerateConfig(pause_mode="abort"))
    for mode in ("retract", "in_place"):
        assert "--disable-radix-cache" in sglang_command("/m", 30001, GenerateConfig(pause_mode=mode))


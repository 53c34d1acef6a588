"""The vLLM backend's rules that need no server (the servers: test_vllm.py, -m vllm)."""

from __future__ import annotations

import json

import pytest

from realscale.config import ConfigError, GenerateConfig


def test_config_refuses_truncated_sampling_with_vllm() -> None:
    """vLLM reports log-probs after top-k/top-p truncation; the trainer's are before it."""
    GenerateConfig(backend="vllm")
    for kw in ({"top_p": 0.9}, {"top_k": 20}):
        with pytest.raises(ConfigError, match="generate.backend=vllm"):
            GenerateConfig(backend="vllm", **kw)
    GenerateConfig(backend="embedded", top_p=0.9)


def test_command_and_environment() -> None:
    from realscale.inference.vllm_server import vllm_command, vllm_env

    g = GenerateConfig(backend="vllm", tp=2, context_length=1024, max_running_requests=16, cpu_threads=3,
                       vllm_kv_cache_mb=256)
    cmd = vllm_command("/models/m", 4321, g, seed=5)
    args = dict(zip(cmd, cmd[1:]))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert (args["--model"], args["--port"], args["--seed"], args["--dtype"]) == ("/models/m", "4321", "5", "float32")
    assert (args["--tensor-parallel-size"], args["--max-model-len"], args["--max-num-seqs"]) == ("2", "1024", "16")
    assert args["--logprobs-mode"] == "processed_logprobs" and "--enable-scale-out" in cmd
    assert json.loads(args["--weight-transfer-config"]) == {"backend": "gloo"}
    assert "--gpu-memory-utilization" not in cmd and args["--kv-cache-memory-bytes"] == str(256 << 20)
    gpu_cmd = vllm_command("/m", 1, g, on_gpu=True)
    gpu = dict(zip(gpu_cmd, gpu_cmd[1:]))
    assert json.loads(gpu["--weight-transfer-config"]) == {"backend": "nccl"}
    assert gpu["--gpu-memory-utilization"] == str(g.mem_fraction_static)
    assert "--kv-cache-memory-bytes" not in gpu_cmd
    env = vllm_env(g, base={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("3", "nobind")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_dialect_pause_modes_and_sampling_params() -> None:
    from realscale.inference.vllm_dialect import VllmDialect, sampling_params, vllm_version

    d = VllmDialect()
    assert d.pause("abort") == [("/pause?mode=abort", {})] and d.resume("abort") == [("/resume", {})]
    assert d.pause("retract") == d.pause("in_place") == [("/pause?mode=keep", {})]
    assert d.resume("retract")[0][0] == "/reset_prefix_cache?reset_running_requests=true"
    assert d.resume("in_place")[0][0] == "/reset_prefix_cache"
    with pytest.raises(ValueError, match="pause mode"):
        d.pause("wait")
    assert sampling_params({"max_new_tokens": 5, "temperature": 0.5, "ignore_eos": True}) == \
        {"max_tokens": 5, "temperature": 0.5, "ignore_eos": True, "logprobs": 0}
    with pytest.raises(ValueError, match="no vLLM counterpart"):
        sampling_params({"max_new_tokens": 5, "regex": "a+"})
    assert vllm_version("default") == 0 and vllm_version("3") == 3
    calls = d.load_from_disk("/w/v3", 3)
    assert calls == [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/w/v3"}}),
                     ("/update_weight_version", {"new_version": "3"})]


def test_model_check_names_unsupported_head_size(tmp_path, monkeypatch) -> None:
    from realscale.inference import vllm_server

    monkeypatch.setattr(vllm_server, "installed_vllm", lambda: "0.32.0")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ValueError, match="head size 16"):
        vllm_server.check_model(str(tmp_path))
    vllm_server.check_model(str(tmp_path), on_gpu=True)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2}))
    vllm_server.check_model(str(tmp_path))


def test_transport_for_vllm() -> None:
    from realscale.config import Config
    from realscale.publish.disk import DiskTransport
    from realscale.publish.vllm import VllmEngineTransport
    from realscale.publish.publisher import transport_for

    cfg = Config()
    cfg.generate = GenerateConfig(backend="vllm")
    t = transport_for(cfg, "/tmp/run")
    assert isinstance(t, VllmEngineTransport) and t.engine_name == "gloo"
    cfg.generate = GenerateConfig(backend="vllm", weight_update="disk")
    assert isinstance(transport_for(cfg, "/tmp/run"), DiskTransport)

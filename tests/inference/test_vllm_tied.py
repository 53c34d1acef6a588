"""A weight update reaches a tied output head on vLLM-CPU.

vLLM-CPU packs every linear layer's weight for its GEMM kernels when weights are loaded,
the output head too (``UnquantizedEmbeddingMethod.process_weights_after_loading`` ->
``dispatch_cpu_unquantized_gemm``: vllm 0.32 ``model_executor/layers/vocab_parallel_embedding.py``
67-71, ``model_executor/layers/utils.py`` 470-600: oneDNN's handle holds its own copy). A
tied head shares the embedding's parameter, but no update carries ``lm_head.weight``, so
vLLM's layer-wise reload (``model_loader/reload/layerwise.py`` 255-267) never repacks it:
the new embedding would reach the input while the logits kept the old head. On GPUs the
method packs nothing and the shared parameter is the head. Served log-probs after an
update must equal the trainer's for a tied model on both update paths (the gloo weight
engine and a load from disk)."""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import asdict
from importlib.metadata import entry_points

import pytest

import real_engines as cases
from realscale.parallel.spawn import run_distributed

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc, pytest.mark.timeout(1200)]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]')", allow_module_level=True)
if not any(ep.value.startswith("realscale.") for ep in entry_points(group="vllm.general_plugins")):
    pytest.skip("realscale's vLLM plugin is not registered: install realscale with pip (-e .)",
                allow_module_level=True)

TOL = 1e-3  # as tests/inference/test_vllm.py (fp32 on both sides; the gaps it measured, the margin it checks)
PROMPT = list(range(40, 70))
PARAMS = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tied")
    return cases.tiny_tied_model(str(root / "base"), 0), cases.tiny_tied_model(str(root / "new"), 7)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    from realscale.config import GenerateConfig

    gen = GenerateConfig(backend="vllm", max_running_requests=8, context_length=512, vllm_kv_cache_mb=64,
                         vllm_enforce_eager=True)
    with cases.engine_servers(models[0], [gen], str(tmp_path_factory.mktemp("logs")), "vLLM server", 1200) as s:
        yield s[0]


def _client(url):
    from realscale.inference.client import InferenceClient
    from realscale.inference.vllm_dialect import VllmDialect

    return InferenceClient([url], dialect=VllmDialect(), request_timeout=300)


async def _load(url, model_dir, version):
    async with _client(url) as c:
        await c.update_weights_from_disk(model_dir, weight_version=version)


def test_update_through_the_gloo_engine_reaches_the_tied_head(server, models, tmp_path) -> None:
    from realscale.config import Config

    base, new = models
    url, tp, _ = server
    asyncio.run(_load(url, base, 0))
    cfg = Config()
    cfg.generate.backend = "vllm"
    out = run_distributed(cases.publish_to_servers, 1, asdict(cfg), base, new, [(url, tp)], str(tmp_path), [1],
                          PROMPT, PARAMS, timeout=900)[0]
    served, trained = out["served"][0], out["trained"][0]
    assert set(out["versions"][0]) == {1}
    before = cases.engine_lps(base, [PROMPT], out["outputs"], 1.0)[0]
    assert cases.max_diff(before, trained) > 1e-2  # the two models differ where the test looks
    assert cases.max_diff(served, trained) < TOL


def test_load_from_disk_reaches_the_tied_head(server, models) -> None:
    base, new = models
    url, _, _ = server
    asyncio.run(_load(url, base, 0))
    asyncio.run(_load(url, new, 1))
    results, diff = cases.served_vs_megatron(_client_for, [url], new, [PROMPT], 1.0)
    assert set(results[0].output_versions) == {1}
    before = cases.engine_lps(base, [PROMPT], [results[0].output_ids], 1.0)[0]
    assert cases.max_diff(before, results[0].output_logprobs) > 1e-2  # the new model, not the base, served them
    assert diff < TOL


def _client_for(urls):
    return _client(urls[0])

"""Our protocol against SGLang's own definitions, parsed from its source with ast.

Needs the SGLang source files: ``python scripts/fetch_sglang_source.py`` (downloads the
wheel with ``pip download --no-deps``; nothing is installed). Skipped when absent.
"""

from __future__ import annotations

import os

import pytest
import requests

from realscale.generate import protocol as P
from realscale.generate import sglang_reference as ref

SRC = ref.find_source()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not fetched: run "
                                "'python scripts/fetch_sglang_source.py' (needs PyPI access)")


def _fields(rel: str, cls: str) -> set[str]:
    return set(ref.class_fields(os.path.join(SRC, rel), cls))


IO = "sglang/srt/managers/io_struct.py"


@pytest.mark.parametrize("ours, cls", [
    (P.GENERATE_FIELDS | set(P.GENERATE_DEFAULT_ONLY), "GenerateReqInput"),
    (P.PAUSE_FIELDS, "PauseGenerationReqInput"),
    (P.CONTINUE_FIELDS, "ContinueGenerationReqInput"),
    (P.ABORT_FIELDS, "AbortReq"),
    (P.DISK_FIELDS, "UpdateWeightFromDiskReqInput"),
    (P.INIT_GROUP_FIELDS, "InitWeightsUpdateGroupReqInput"),
    (P.DIST_FIELDS, "UpdateWeightsFromDistributedReqInput"),
])
def test_request_fields_are_sglangs(ours: set[str], cls: str) -> None:
    theirs = _fields(IO, cls)
    assert ours <= theirs, f"fields not in SGLang's {cls}: {sorted(ours - theirs)}"


def test_required_weight_fields_match() -> None:
    # Fields without a default in SGLang are the ones a client must send.
    for cls, must in [("InitWeightsUpdateGroupReqInput", {"master_address", "master_port", "rank_offset",
                                                          "world_size"}),
                      ("UpdateWeightsFromDistributedReqInput", {"names", "dtypes", "shapes"}),
                      ("UpdateWeightFromDiskReqInput", {"model_path"})]:
        assert must <= _fields(IO, cls)


def test_sampling_params_are_sglangs() -> None:
    theirs = _fields("sglang/srt/sampling/sampling_params.py", "SamplingParams")
    ours = P.SAMPLING_FIELDS | set(P.SAMPLING_DEFAULT_ONLY)
    assert ours <= theirs, sorted(ours - theirs)


def test_response_fields_are_sglangs(tiny_server, tmp_path) -> None:
    """Weight-update replies carry SGLang's output-struct fields; version spans use its names."""
    url, server = tiny_server
    disk = requests.post(url + "/update_weights_from_disk", json={"model_path": server.model_path}, timeout=60).json()
    theirs = _fields(IO, "UpdateWeightFromDiskReqOutput") - {"rid", "http_worker_ipc"}
    assert theirs <= set(disk), sorted(theirs - set(disk))
    span_fields = _fields("sglang/srt/managers/io_struct.py", "AbortReq")
    assert "weight_versions" in span_fields
    with open(os.path.join(SRC, "sglang/srt/entrypoints/http_server.py"), encoding="utf-8") as fh:
        http = fh.read()
    for path in ["/generate", "/abort_request", "/pause_generation", "/continue_generation",
                 "/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
                 "/flush_cache", "/health", "/health_generate", "/get_model_info", "/get_server_info"]:
        assert f'"{path}"' in http, path
    routed = {res.canonical for res in server.app().router.resources()}
    missing = [p for p in ("/generate", "/abort_request", "/pause_generation", "/continue_generation",
                           "/update_weights_from_disk", "/init_weights_update_group",
                           "/update_weights_from_distributed", "/flush_cache", "/health", "/health_generate",
                           "/get_model_info", "/get_server_info") if p not in routed]
    assert not missing, missing

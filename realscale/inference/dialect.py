"""How the client speaks to a server's HTTP API: a :class:`Dialect` builds request bodies
and parses replies. This one is SGLang's (``/generate``, ``/pause_generation``, ...), which
the embedded server speaks too; vLLM's overrides it in :mod:`realscale.inference.vllm_dialect`."""

from __future__ import annotations

import dataclasses
from typing import Any


def parse_version(v: Any) -> Any:
    """Weight versions travel as strings (SGLang); numeric ones come back as ints."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return v


def expand_spans(spans: list[dict[str, Any]], n: int, fallback: Any) -> list[Any]:
    """SGLang ``weight_versions`` spans -> one version per output token (``fallback`` where uncovered)."""
    out = [fallback] * n
    for span in spans or []:
        for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            out[i] = span["version"]
    return out


@dataclasses.dataclass
class Segment:
    """One reply of a generate call: the tokens since the request (or the resubmission)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[Any]
    finish_reason: dict[str, Any]  # {"type": "stop" | "length" | "abort", ...}
    text: str = ""


class Dialect:
    """SGLang's HTTP API (``/generate``, ``/pause_generation``, ...), which the embedded
    server speaks too. A server API that differs overrides these (vllm_dialect.py)."""

    name = "sglang"
    generate_path = "/generate"
    # "Is the server there?" without generating: what a weight update asks of paused
    # servers. Not /health: in the pinned SGLang (0.5.23) /health is the /health_generate
    # handler (sglang/srt/entrypoints/http_server.py:721-723; SGLANG_ENABLE_HEALTH_ENDPOINT_
    # GENERATION defaults to true, sglang/srt/environ.py:344), which submits a one-token
    # generation that waits behind a pause (tokenizer_manager.py:938-939) and answers 503
    # after SGLANG_HEALTH_CHECK_TIMEOUT, 20 s (http_server.py:218, 779-799), marking the server
    # unhealthy. /model_info (http_server.py:812-813) reads the tokenizer manager's state only:
    # no generation, no scheduler round trip, answered while paused. (/ping, http_server.py:
    # 2190-2198, would also answer while paused, but stays 503 after one failed /health.)
    liveness_path = "/model_info"

    def generate_body(self, input_ids: list[int], params: dict[str, Any], rid: str) -> dict[str, Any]:
        return {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "rid": rid}

    def parse_generate(self, reply: dict[str, Any]) -> Segment:
        meta = reply["meta_info"]
        ids = list(reply["output_ids"])
        current = parse_version(meta.get("weight_version"))
        versions = [parse_version(v) for v in expand_spans(meta.get("weight_versions"), len(ids), current)]
        return Segment(ids, [float(x[0]) for x in meta.get("output_token_logprobs", [])], versions,
                       meta["finish_reason"] or {"type": "abort"}, reply.get("text") or "")

    def abort(self, rid: str) -> list[tuple[str, dict[str, Any]]]:
        """The calls that end request ``rid`` on its server, which then answers it with its
        partial output (a request past its time limit)."""
        return [("/abort_request", {"rid": rid})]

    def pause(self, mode: str) -> list[tuple[str, dict[str, Any]]]:
        """The calls (path, body), in order, that pause a server in ``generate.pause_mode``."""
        return [("/pause_generation", {"mode": mode})]

    def resume(self, mode: str) -> list[tuple[str, dict[str, Any]]]:
        """The calls that resume a server paused in ``mode``."""
        return [("/continue_generation", {})]

    def load_from_disk(self, path: str, weight_version: Any,
                       flush_cache: bool = True) -> list[tuple[str, dict[str, Any]]]:
        """The calls (in order, to each server) that load an HF directory and tag it."""
        body: dict[str, Any] = {"model_path": path, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return [("/update_weights_from_disk", body)]

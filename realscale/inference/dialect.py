"""How the client speaks to a server's HTTP API: a :class:`Dialect` builds request bodies
and parses replies. This one is SGLang's (``/generate``, ``/pause_generation``, ...), which
the embedded server speaks too; vLLM's overrides it in :mod:`realscale.inference.vllm_dialect`."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np


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


def encode_routed_experts(rows: np.ndarray) -> str:
    """SGLang's ``meta_info["routed_experts"]``: the experts each token position was
    routed to, ``(positions, layers, top_k)`` int32, as base64 of the C-order bytes
    (pinned SGLang 0.5.23: its capturer's buffers are int32, ``srt/state_capturer/base.py:40,
    70``; ``srt/managers/detokenizer_manager.py:432-445`` encodes each request's ``(token,
    layer, top_k)`` tensor with ``pybase64.b64encode(t.numpy().tobytes())`` and
    ``srt/state_capturer/routed_experts.py:166-173`` decodes it as int32;
    ``srt/managers/io_struct.py:264-268``: the rows cover positions
    ``[routed_experts_start_len, seqlen - 1)``)."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(text: str) -> np.ndarray:
    """The flat int32 expert ids of :func:`encode_routed_experts` (the caller knows the rows)."""
    return np.frombuffer(base64.b64decode(text), dtype=np.int32).copy()


@dataclasses.dataclass
class Segment:
    """One reply of a generate call: the tokens since the request (or the resubmission)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[Any]
    finish_reason: dict[str, Any]  # {"type": "stop" | "length" | "abort", ...}
    text: str = ""
    routed_experts: np.ndarray | None = None  # flat int32 (positions x layers x top_k), when asked for


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

    def generate_body(self, input_ids: list[int], params: dict[str, Any], rid: str,
                      routing_from: int | None = None) -> dict[str, Any]:
        """``routing_from``: also ask for the experts every position from this one on was
        routed to (SGLang's ``return_routed_experts`` / ``routed_experts_start_len``)."""
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "rid": rid}
        if routing_from is not None:
            body.update(return_routed_experts=True, routed_experts_start_len=routing_from)
        return body

    def parse_generate(self, reply: dict[str, Any]) -> Segment:
        meta = reply["meta_info"]
        ids = list(reply["output_ids"])
        current = parse_version(meta.get("weight_version"))
        versions = [parse_version(v) for v in expand_spans(meta.get("weight_versions"), len(ids), current)]
        routed = meta.get("routed_experts")
        return Segment(ids, [float(x[0]) for x in meta.get("output_token_logprobs", [])], versions,
                       meta["finish_reason"] or {"type": "abort"}, reply.get("text") or "",
                       None if routed is None else decode_routed_experts(routed))

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

"""SGLang's native HTTP protocol as the pinned SGLang speaks it: field names, parsing, responses.

Field names and semantics follow the pinned SGLang (``sglang_reference.PINNED``):
``srt/managers/io_struct.py`` (``GenerateReqInput`` and the control requests), its HTTP
JSON contract ``api/v1/api_types.py`` (which ``/generate`` bodies it refuses) and
``srt/entrypoints/http_server.py`` (routes and response shapes). The contract tests derive
every name from that source; nothing here is a copy of it.

How the embedded server treats a request body, as SGLang does:

- ``/generate``: every ``GenerateReqInput`` field is accepted. :data:`GENERATE_FIELDS`
  are implemented; :data:`GENERATE_IGNORED` only steer routing, scheduling, caching or
  logging and change nothing in a single-process server's output; every other field names
  a feature the embedded server lacks (images, LoRA, hidden states, sessions, ...) and is
  accepted while unset (null, false, 0, empty) and refused with HTTP 400 naming it
  otherwise. Keys SGLang does not know are ignored (SGLang's contract ignores unknown
  top-level keys). ``sampling_params`` is strict, as SGLang's contract is: an unknown key
  is refused, and the fields of :data:`SAMPLING_DEFAULT_ONLY` only at their default.
- control routes (pause, weights, groups, abort): SGLang parses them into msgspec structs
  through pydantic in lax mode, so unknown keys are ignored and integer fields accept
  integer strings (AReaL 1.0.4 sends ``"master_port": "29500"``).

Response ``meta_info`` follows SGLang: ``id``, ``finish_reason`` (``{"type": "stop",
"matched": ...}``, ``{"type": "length", "length": n}``, an aborted running request's
``{"type": "abort", "message", "status_code", "err_type"}`` or a waiting one's ``{"type":
"abort", "message": "Abort in waiting queue"}``), ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``reasoning_tokens``, ``weight_version``, ``weight_versions`` (spans
``{"version", "start", "end"}`` over the output tokens: the policy version of every
token), ``num_retractions``, ``e2e_latency``, with ``return_routed_experts`` (a
mixture-of-experts model) ``routed_experts`` (base64 int32 ``(positions, layers, top_k)``
over positions ``[routed_experts_start_len, seqlen - 1)``, which must start within the
prompt) and, with ``return_logprob``,
``input_token_logprobs`` (empty: only ``logprob_start_len = -1`` is served),
``output_token_logprobs`` as ``[logprob, token_id, text or null]`` and
``output_token_logprobs_length``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from aiohttp import web

from realscale.serve.engine import SamplingOptions, running_abort, waiting_abort  # noqa: F401 - SGLang's shapes


class ProtocolError(ValueError):
    """A malformed request; the message names the offending field."""


# ---------------------------------------------------------------- /generate
# GenerateReqInput fields the embedded server implements.
GENERATE_FIELDS = {"rid", "text", "input_ids", "sampling_params", "return_logprob", "stream",
                   "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "return_prompt_token_ids",
                   "return_routed_experts", "routed_experts_start_len"}
# Only -1 (output log-probs only) and no top log-probs are served.
GENERATE_DEFAULT_ONLY = {"logprob_start_len": -1, "top_logprobs_num": 0}
# Accepted with any value: routing, scheduling, cache namespaces, metrics and logging hints.
GENERATE_IGNORED = {"log_metrics", "no_logs", "priority", "routing_key", "conversation_id", "custom_labels",
                    "extra_key", "cache_salt", "received_time", "external_trace_header", "http_worker_ipc",
                    "background"}
# Features the embedded server lacks: accepted unset, refused otherwise.
GENERATE_UNSET_ONLY = {
    # multimodal inputs
    "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
    "use_audio_in_video", "video_config", "modalities", "need_wait_for_mm_inputs", "num_items_assigned",
    "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
    "video_max_dynamic_patch", "images_config", "mm_processor_kwargs", "positional_embed_overrides",
    # extra outputs
    "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "return_hidden_states",
    "return_indexer_topk", "return_bytes",
    "return_entropy", "multi_item_delimiter_indices", "token_indices_to_pool",
    # adapters, logit processors, reasoning budgets, watermarks
    "lora_path", "lora_id", "custom_logit_processor", "require_reasoning", "max_thinking_tokens", "watermark",
    # sessions, prefill/decode disaggregation, data-parallel routing, KV hints
    "session_id", "session_params", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
    "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "kv_hints",
}

# SamplingParams (SGLang's contract refuses any other key).
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
                   "skip_special_tokens", "no_stop_trim", "stream_interval"}
SAMPLING_DEFAULT_ONLY = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                         "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None,
                         "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
                         "spaces_between_special_tokens": True, "custom_params": None, "sampling_seed": None,
                         "stop_regex": None, "beam_width": None, "watermark": None, "choice": None}

# ---------------------------------------------------------------- control routes (BaseReq: rid, http_worker_ipc)
_BASE = {"rid", "http_worker_ipc"}
PAUSE_FIELDS = {"mode"} | _BASE
CONTINUE_FIELDS = {"torch_empty_cache"} | _BASE
ABORT_FIELDS = {"abort_all", "finished_reason", "abort_message", "weight_versions"} | _BASE
DISK_FIELDS = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
               "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache",
               "manifest"} | _BASE
INIT_GROUP_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"} | _BASE
DESTROY_GROUP_FIELDS = {"group_name"} | _BASE
DIST_FIELDS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
               "load_format", "selector", "torch_empty_cache"} | _BASE
BEGIN_FIELDS = {"selector"} | _BASE
END_FIELDS = set(_BASE)
VERSION_FIELDS = {"new_version", "abort_all_requests"} | _BASE

# io_struct's default group name for the weight-update routes
DEFAULT_GROUP = "weight_update_group"
SELECTORS = ("target", "draft", "all")


def is_unset(value: Any) -> bool:
    """null, false, 0, "", [] and {} -- and a batch list of those."""
    if isinstance(value, list) and value:
        return all(is_unset(v) for v in value)
    return value is None or value is False or value == 0 or value in ("", [], {})


def check_object(body: Any, allowed: set[str], what: str, strict: bool = True) -> dict[str, Any]:
    """``body`` must be a JSON object; with ``strict``, every key must be in ``allowed``
    (SGLang's lax routes leave unknown keys out instead)."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown and strict:
        raise ProtocolError(f"{what}: unknown field(s) {', '.join(map(repr, unknown))}")
    return {k: v for k, v in body.items() if k in allowed}


_INT_STRING = re.compile(r"^[+-]?\d+$")


def _lax_int(value: Any) -> Any:
    """pydantic's lax mode: ``"29500"`` and ``29500.0`` are the integer 29500."""
    if isinstance(value, str) and _INT_STRING.match(value.strip()):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _typed(obj: dict[str, Any], key: str, types: tuple[type, ...], what: str, default: Any = None,
           lax: bool = False) -> Any:
    value = obj.get(key, default)
    if value is None:
        return default
    if lax and int in types and not isinstance(value, bool):
        value = _lax_int(value)
    # bool is an int subclass: refuse it where a number is meant, as JSON schemas do.
    if isinstance(value, bool) and bool not in types:
        raise ProtocolError(f"{what}.{key}: expected {'/'.join(t.__name__ for t in types)}, got bool")
    if not isinstance(value, types):
        raise ProtocolError(f"{what}.{key}: expected {'/'.join(t.__name__ for t in types)}, "
                            f"got {type(value).__name__}")
    return value


def require(obj: dict[str, Any], key: str, types: tuple[type, ...], what: str, lax: bool = False) -> Any:
    if obj.get(key) is None:
        raise ProtocolError(f"{what}: missing required field {key!r}")
    return _typed(obj, key, types, what, lax=lax)


def optional(obj: dict[str, Any], key: str, types: tuple[type, ...], what: str, default: Any = None,
             lax: bool = False) -> Any:
    return _typed(obj, key, types, what, default, lax=lax)


def _check_defaults(obj: dict[str, Any], defaults: dict[str, Any], what: str) -> None:
    """Fields of ``defaults`` may be absent, null, their default or (where the default is
    null) unset; anything else names a feature the embedded server lacks."""
    for key, default in defaults.items():
        value = obj.get(key)
        values = value if isinstance(value, list) and not isinstance(default, list) and default is not None else [value]
        for v in values:
            if v is not None and v != default and not (default is None and is_unset(v)):
                raise ProtocolError(f"{what}.{key}: not supported by the embedded server (only {default!r})")


def parse_sampling_params(raw: Any, default_max_new_tokens: int = 128) -> SamplingOptions:
    """SGLang ``sampling_params`` -> :class:`SamplingOptions` (SGLang defaults for what is missing)."""
    what = "sampling_params"
    sp = check_object(raw, SAMPLING_FIELDS | set(SAMPLING_DEFAULT_ONLY), what)
    _check_defaults(sp, SAMPLING_DEFAULT_ONLY, what)
    opts = SamplingOptions(
        max_new_tokens=optional(sp, "max_new_tokens", (int,), what, default_max_new_tokens),
        temperature=float(optional(sp, "temperature", (int, float), what, 1.0)),
        top_p=float(optional(sp, "top_p", (int, float), what, 1.0)),
        top_k=optional(sp, "top_k", (int,), what, -1),
        ignore_eos=optional(sp, "ignore_eos", (bool,), what, False),
        skip_special_tokens=optional(sp, "skip_special_tokens", (bool,), what, True),
        no_stop_trim=optional(sp, "no_stop_trim", (bool,), what, False),
    )
    stop = optional(sp, "stop", (str, list), what, [])
    opts.stop = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) for s in opts.stop):
        raise ProtocolError(f"{what}.stop: expected a string or a list of strings")
    ids = optional(sp, "stop_token_ids", (list,), what, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ProtocolError(f"{what}.stop_token_ids: expected a list of integers")
    opts.stop_token_ids = list(ids)
    if opts.max_new_tokens < 0:
        raise ProtocolError(f"{what}.max_new_tokens: must be >= 0, got {opts.max_new_tokens}")
    if not math.isfinite(opts.temperature) or opts.temperature < 0:
        raise ProtocolError(f"{what}.temperature: must be a non-negative finite number, got {opts.temperature}")
    if not 0.0 < opts.top_p <= 1.0:
        raise ProtocolError(f"{what}.top_p: must be in (0, 1], got {opts.top_p}")
    if opts.top_k == 0 or opts.top_k < -1:
        raise ProtocolError(f"{what}.top_k: must be -1 (off) or >= 1, got {opts.top_k}")
    return opts


def stream_interval(raw: Any) -> int:
    """``sampling_params.stream_interval``: tokens between two streamed chunks (default 1)."""
    value = optional(raw if isinstance(raw, dict) else {}, "stream_interval", (int,), "sampling_params", 1)
    if value < 1:
        raise ProtocolError(f"sampling_params.stream_interval: must be >= 1, got {value}")
    return value


def per_item(req: dict[str, Any], key: str, n: int, default: Any = None) -> list[Any]:
    """A field given once for the whole batch or as a list with one entry per item."""
    value = req.get(key)
    if value is None:
        return [default] * n
    if isinstance(value, list) and key != "stop":
        if len(value) != n:
            raise ProtocolError(f"generate.{key}: a list of {len(value)} for a batch of {n}")
        return [default if v is None else v for v in value]
    return [value] * n


def parse_generate(body: Any, vocab_size: int) -> tuple[list[list[int]] | None, list[str] | None, dict[str, Any]]:
    """Validate a ``/generate`` body; returns (input_ids batch, texts batch, body).

    Exactly one of ``input_ids`` / ``text`` is given, single or batched; the batch form
    answers with a JSON list. Unknown keys are dropped (SGLang ignores them).
    """
    what = "generate"
    req = check_object(body, GENERATE_FIELDS | GENERATE_IGNORED | GENERATE_UNSET_ONLY, what, strict=False)
    for key in sorted(GENERATE_UNSET_ONLY & set(req)):
        if not is_unset(req[key]):
            raise ProtocolError(f"generate.{key}: not supported by the embedded server (only null or unset)")
    _check_defaults(req, GENERATE_DEFAULT_ONLY, what)
    has_ids, has_text = req.get("input_ids") is not None, req.get("text") is not None
    if has_ids == has_text:
        raise ProtocolError("generate: give exactly one of 'input_ids' or 'text'")
    for key in ("stream", "return_text_in_logprobs", "return_prompt_token_ids", "return_routed_experts"):
        optional(req, key, (bool,), what)
    start = req.get("routed_experts_start_len")
    if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
        raise ProtocolError(f"generate.routed_experts_start_len: expected an integer >= 0, got {start!r}")
    if has_text:
        text = req["text"]
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ProtocolError("generate.text: expected a string or a non-empty list of strings")
        return None, texts, req
    ids = req["input_ids"]
    batch = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids]
    for seq in batch:
        if not isinstance(seq, list) or not seq:
            raise ProtocolError("generate.input_ids: expected a non-empty list of token ids (or a list of such lists)")
        for tok in seq:
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab_size:
                raise ProtocolError(f"generate.input_ids: {tok!r} is not a token id in [0, {vocab_size})")
    return batch, None, req


def is_single(req: dict[str, Any]) -> bool:
    """A single request (answered with an object) rather than a batch (a list)."""
    if req.get("text") is not None:
        return isinstance(req["text"], str)
    ids = req.get("input_ids")
    return not (isinstance(ids, list) and ids and isinstance(ids[0], list))


def rid_list(req: dict[str, Any], n: int) -> list[str | None]:
    """The request ids of a batch of ``n``: SGLang takes a string for one request, expands a
    string to ``{rid}_{i}`` for a batch, or takes one string per item."""
    rid = req.get("rid")
    if rid is None:
        return [None] * n
    if isinstance(rid, str):
        return [rid] if is_single(req) else [f"{rid}_{i}" for i in range(n)]
    if not isinstance(rid, list) or len(rid) != n or not all(isinstance(r, str) for r in rid):
        raise ProtocolError(f"generate.rid: expected a string or a list of {n} strings")
    return list(rid)


def version_spans(versions: list[str], current: str) -> list[dict[str, Any]]:
    """Per-token versions -> SGLang ``weight_versions`` spans (one empty span if no tokens)."""
    if not versions:
        return [{"version": current, "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


#END


async def read_json(request: web.Request) -> Any:
    """A request's JSON body (None when empty); a ProtocolError when it is not JSON."""
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from None


def failure(message: str, **extra: Any) -> web.Response:
    """SGLang's failure shape (success/message) plus our uniform ``error`` field, HTTP 400."""
    return web.json_response({"success": False, "message": message, **extra, "error": message}, status=400)

"""The SGLang native HTTP protocol subset that RL needs: field names, parsing, responses.

Field names and semantics follow SGLang's ``srt/managers/io_struct.py``
(``GenerateReqInput``, ``PauseGenerationReqInput``, ``UpdateWeightFromDiskReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``AbortReq``) and ``srt/sampling/sampling_params.py``. A request with an unknown field,
a wrong type, or an SGLang feature the embedded server does not implement is refused
with :class:`ProtocolError` (HTTP 400 with ``{"error": "..."}``) naming the field.

Response ``meta_info`` follows SGLang: ``id``, ``finish_reason`` (``{"type": "stop",
"matched": ...}``, ``{"type": "length", "length": n}`` or ``{"type": "abort",
"message": ...}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
``weight_version``, ``weight_versions`` (spans ``{"version", "start", "end"}`` over the
output tokens: the policy version of every token), ``num_retractions``, ``e2e_latency``
and, with ``return_logprob``, ``output_token_logprobs`` as ``[logprob, token_id, null]``.
"""

from __future__ import annotations

import math
from typing import Any

from realscale.generate.engine import SamplingOptions


class ProtocolError(ValueError):
    """A malformed request; the message names the offending field."""


# GenerateReqInput fields we implement, and SGLang fields we accept only at their default.
GENERATE_FIELDS = {"rid", "text", "input_ids", "sampling_params", "return_logprob", "stream",
                   "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "log_metrics"}
GENERATE_DEFAULT_ONLY = {"stream": False, "logprob_start_len": -1, "top_logprobs_num": 0,
                         "return_text_in_logprobs": False}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
                   "skip_special_tokens", "no_stop_trim"}
SAMPLING_DEFAULT_ONLY = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                         "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None,
                         "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
                         "spaces_between_special_tokens": True, "stream_interval": None, "custom_params": None,
                         "sampling_seed": None}

PAUSE_FIELDS = {"mode", "rid"}
CONTINUE_FIELDS = {"torch_empty_cache", "rid"}
ABORT_FIELDS = {"rid", "abort_all", "abort_message"}
DISK_FIELDS = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
               "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "rid"}
INIT_GROUP_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "rid"}
DIST_FIELDS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
               "load_format", "selector", "torch_empty_cache", "rid"}


def check_object(body: Any, allowed: set[str], what: str) -> dict[str, Any]:
    """``body`` must be a JSON object whose keys are all in ``allowed``."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ProtocolError(f"{what}: unknown field(s) {', '.join(map(repr, unknown))}")
    return body


def _typed(obj: dict[str, Any], key: str, types: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = obj.get(key, default)
    if value is None:
        return default
    # bool is an int subclass: refuse it where a number is meant, as JSON schemas do.
    if isinstance(value, bool) and bool not in types:
        raise ProtocolError(f"{what}.{key}: expected {'/'.join(t.__name__ for t in types)}, got bool")
    if not isinstance(value, types):
        raise ProtocolError(f"{what}.{key}: expected {'/'.join(t.__name__ for t in types)}, "
                            f"got {type(value).__name__}")
    return value


def require(obj: dict[str, Any], key: str, types: tuple[type, ...], what: str) -> Any:
    if obj.get(key) is None:
        raise ProtocolError(f"{what}: missing required field {key!r}")
    return _typed(obj, key, types, what)


def optional(obj: dict[str, Any], key: str, types: tuple[type, ...], what: str, default: Any = None) -> Any:
    return _typed(obj, key, types, what, default)


def parse_sampling_params(raw: Any, default_max_new_tokens: int = 128) -> SamplingOptions:
    """SGLang ``sampling_params`` -> :class:`SamplingOptions` (SGLang defaults for what is missing)."""
    what = "sampling_params"
    sp = check_object(raw, SAMPLING_FIELDS | set(SAMPLING_DEFAULT_ONLY), what)
    for key, default in SAMPLING_DEFAULT_ONLY.items():
        if key in sp and sp[key] is not None and sp[key] != default:
            raise ProtocolError(f"{what}.{key}: not supported by the embedded server (only {default!r})")
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


def parse_generate(body: Any, vocab_size: int) -> tuple[list[list[int]] | None, list[str] | None, dict[str, Any]]:
    """Validate a ``/generate`` body; returns (input_ids batch, texts batch, body).

    Exactly one of ``input_ids`` / ``text`` is given, single or batched; the batch form
    answers with a JSON list.
    """
    req = check_object(body, GENERATE_FIELDS | {"sampling_params"}, "generate")
    for key, default in GENERATE_DEFAULT_ONLY.items():
        if key in req and req[key] is not None and req[key] != default:
            raise ProtocolError(f"generate.{key}: not supported by the embedded server (only {default!r})")
    has_ids, has_text = req.get("input_ids") is not None, req.get("text") is not None
    if has_ids == has_text:
        raise ProtocolError("generate: give exactly one of 'input_ids' or 'text'")
    optional(req, "return_logprob", (bool,), "generate")
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


def rid_list(req: dict[str, Any], n: int) -> list[str | None]:
    """The request ids for a batch of ``n`` (SGLang: a str for one, a list for a batch)."""
    rid = req.get("rid")
    if rid is None:
        return [None] * n
    rids = [rid] if isinstance(rid, str) else rid
    if not isinstance(rids, list) or len(rids) != n or not all(isinstance(r, str) for r in rids):
        raise ProtocolError(f"generate.rid: expected {'a string' if n == 1 else f'a list of {n} strings'}")
    return rids


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


def expand_spans(spans: list[dict[str, Any]], n: int, fallback: Any) -> list[Any]:
    """SGLang ``weight_versions`` spans -> one version per output token (``fallback`` where uncovered)."""
    out = [fallback] * n
    for span in spans or []:
        for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            out[i] = span["version"]
    return out

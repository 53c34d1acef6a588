"""Run real megatron-core layers on CPU with the gloo backend.

megatron-core is written for CUDA: it asks ``torch.cuda`` for the current device, makes
tensors with ``device="cuda"``, seeds a CUDA RNG tracker, synchronises streams, and
refuses torch's own LayerNorm/RMSNorm under sequence parallelism. On a machine without
CUDA each of those calls can only raise, so this module gives them CPU meanings. With
them, tensor parallel (+ sequence parallel), pipeline parallel (the 1F1B schedule of
``get_forward_backward_func``), Megatron DDP, the distributed optimizer and grad-norm
clipping run unchanged on gloo; the tests compare every one of them against a
single-process run.

Use::

    import megatron_patches.cpu as mp_cpu
    mp_cpu.apply()          # no-op with CUDA present, unless apply(force=True)

``apply()`` is idempotent. Every patch below names the megatron-core call sites it
covers; :data:`SUPPORTED` lists the versions the call sites were read from, and any
other version is refused with a message that says so (set
``REALSCALE_MEGATRON_UNCHECKED=1`` to try anyway).

Nothing here changes numerics: the patched calls only pick devices, RNG streams and
no-op synchronisation.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import types
from typing import Any, Callable, Iterator

SUPPORTED = ("0.16.1",)
"""megatron-core versions whose call sites this module was checked against."""

_applied: list[str] = []


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is not one this module was checked against."""


# --------------------------------------------------------------------------- helpers


def _megatron_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def check_version() -> str:
    """The installed megatron-core version, or a clear error when it is not supported."""
    try:
        version = _megatron_version()
    except ImportError as exc:
        raise UnsupportedMegatronVersion(f"megatron-core is not installed ({exc}); pip install megatron-core==0.16.1") from None
    if version not in SUPPORTED and os.environ.get("REALSCALE_MEGATRON_UNCHECKED") != "1":
        raise UnsupportedMegatronVersion(
            f"megatron_patches.cpu was checked against megatron-core {', '.join(SUPPORTED)}, "
            f"but {version} is installed. Install megatron-core=={SUPPORTED[-1]} "
            "(Python 3.11 selects it), or set REALSCALE_MEGATRON_UNCHECKED=1 to try anyway."
        )
    return version


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spec to the CPU; leave everything else alone."""
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu"
    text = str(device)
    return "cpu" if text.startswith("cuda") else device


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_CpuEvent":
        return _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CpuEvent:
    """Stands in for ``torch.cuda.Event``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _CpuStream()


class _CpuTorch(types.ModuleType):
    """A view of ``torch`` whose tensor factories turn ``device="cuda"`` into the CPU.

    Installed as the ``torch`` global of the few megatron modules that hard-code CUDA
    tensors; every other attribute is torch's own.
    """

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like",
                  "empty_like", "full_like", "randn", "rand")

    def __init__(self, torch_module: types.ModuleType) -> None:
        super().__init__("torch")
        self.__dict__["_torch"] = torch_module
        for name in self._FACTORIES:
            self.__dict__[name] = self._wrap(getattr(torch_module, name))
        self.__dict__["autocast"] = self._autocast

    @staticmethod
    def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def factory(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            kwargs.pop("pin_memory", None)  # pinning needs CUDA
            return fn(*args, **kwargs)

        factory.__wrapped__ = fn  # type: ignore[attr-defined]
        return factory

    def _autocast(self, device_type: str, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_torch"].autocast(_cpu_device(device_type), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_torch"], name)


# --------------------------------------------------------------------------- the patches
# Each patch is a function; its docstring names the call sites it covers.


def _patch_torch_cuda() -> None:
    """``torch.cuda`` entry points that megatron calls unconditionally.

    - ``torch.cuda.current_device()`` as a device argument: tensor_parallel/layers.py,
      mappings.py, utils.py, random.py; pipeline_parallel/p2p_communication.py
      (``_communicate_shapes``, ``_communicate``); distributed/param_and_grad_buffer.py;
      optimizer/distrib_optimizer.py, optimizer.py; transformer/attention.py,
      dot_product_attention.py, module.py, transformer_layer.py; models/gpt/gpt_model.py;
      models/common/embeddings/rotary_pos_embedding.py; parallel_state.py (barrier).
      -> the CPU device.
    - ``torch.cuda.synchronize()``: p2p_communication.py (``_communicate``),
      distributed_data_parallel.py, parallel_state.py -> no-op.
    - ``torch.cuda.current_stream() / default_stream() / Stream / Event``:
      param_and_grad_buffer.py (``start_grad_sync`` / ``finish_grad_sync`` stream waits),
      distributed_data_parallel.py (communication stream) -> a no-op stream.
    - ``Tensor.cuda()``: language_module.py (``setup_embeddings_and_output_layer`` ties
      the first and last pipeline stages' embeddings), distrib_optimizer.py -> stays on CPU.
    """
    import torch

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda device=None: _STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _STREAM  # type: ignore[assignment]
    torch.cuda.Stream = _CpuStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _CpuEvent  # type: ignore[assignment,misc]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]


_HARDCODED_CUDA_MODULES = (
    # pipeline_parallel/schedules.py: ``total_num_tokens = torch.zeros(..., device="cuda")`` in
    # forward_backward_no_pipelining / _with_interleaving / _without_interleaving, and
    # ``torch.autocast("cuda", ...)`` in forward_step.
    "megatron.core.pipeline_parallel.schedules",
    # optimizer/clip_grads.py: ``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32`` /
    # ``count_zeros_fp32`` build norm and overflow buffers with device='cuda'.
    "megatron.core.optimizer.clip_grads",
    # optimizer/optimizer.py: ``found_inf``, ``_dummy_overflow_buf``, ``_scale_one``,
    # ``_scale`` buffers of the mixed-precision and fp32 optimizers.
    "megatron.core.optimizer.optimizer",
    # optimizer/grad_scaler.py: scale tensors (fp16 only).
    "megatron.core.optimizer.grad_scaler",
    # distributed/param_and_grad_buffer.py: ``tmp_warmup_tensor`` of the NCCL UB warm-up.
    "megatron.core.distributed.param_and_grad_buffer",
    # transformer/utils.py: ``get_default_causal_mask`` / ``get_sliding_window_causal_mask``.
    "megatron.core.transformer.utils",
    # tensor_parallel/data.py: ``broadcast_data`` size and payload buffers.
    "megatron.core.tensor_parallel.data",
    # utils.py: ``get_batch_on_this_cp_rank``-style helpers, param-hash checks, l2 norms.
    "megatron.core.utils",
    # dist_checkpointing/exchange_utils.py and strategies/state_dict_saver.py: buffers of
    # the checkpoint load/save exchanges.
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


def _patch_hardcoded_cuda_tensors() -> None:
    """Modules that write ``device="cuda"`` literally (listed in
    :data:`_HARDCODED_CUDA_MODULES` with their call sites) get a ``torch`` whose tensor
    factories put those tensors on the CPU."""
    import torch

    proxy = _CpuTorch(torch)
    for name in _HARDCODED_CUDA_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is not torch and not isinstance(getattr(module, "torch", None), _CpuTorch):
            raise UnsupportedMegatronVersion(f"{name} no longer imports torch as 'torch'; re-check megatron_patches.cpu")
        module.torch = proxy  # type: ignore[attr-defined]


def _patch_rng_tracker() -> None:
    """tensor_parallel/random.py: ``CudaRNGStatesTracker.add`` / ``fork`` and
    ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` seed and swap CUDA generator states
    (``torch.cuda.manual_seed``, ``torch.cuda.default_generators``). On CPU the tracked
    streams are CPU generator states: ``model_parallel_cuda_manual_seed`` then gives each
    tensor-parallel rank its own dropout/initialisation stream exactly as on GPUs."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(self: Any, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self: Any, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig = self.states_[orig_name]
            torch.set_rng_state(orig)
            self._current_state_name = orig_name

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork


def _patch_torch_norm() -> None:
    """transformer/torch_norm.py: ``WrappedTorchNorm.__new__`` asserts
    ``not config.sequence_parallel``. Under sequence parallelism each TP rank normalises
    its own slice of the sequence with the full (replicated) weight, so torch's norm is
    correct as long as the weight's gradient is summed over the TP group: we mark the
    parameters ``sequence_parallel = True``, which is what
    distributed/finalize_model_grads.py (``_allreduce_non_tensor_model_parallel_grads``)
    looks for. This is how Megatron's own fused norms behave."""
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__
    if getattr(original, "_realscale_patched", False):
        return

    def __new__(cls: Any, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, **kwargs)
        # build with sequence_parallel off (the only thing the assertion refuses) ...
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = True
        # ... and mark the weights so their grads are all-reduced over TP.
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__._realscale_patched = True  # type: ignore[attr-defined]
    torch_norm.WrappedTorchNorm.__new__ = __new__  # type: ignore[method-assign]


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """Inside this block a CPU tensor's ``.type()`` answers with the CUDA type name
    (``torch.cuda.FloatTensor``), which is what megatron's dtype checks compare with."""
    import torch

    original = torch.Tensor.type
    if getattr(original, "_realscale_cuda_names", False):  # already inside such a block
        yield
        return

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or not name.startswith("torch.") or self.is_cuda:
            return name
        return "torch.cuda." + name[len("torch."):]

    type_._realscale_cuda_names = True  # type: ignore[attr-defined]
    torch.Tensor.type = type_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    return wrapper


def _patch_tensor_type_checks() -> None:
    """Dtype checks that compare ``tensor.type()`` with ``'torch.cuda.FloatTensor'`` (and
    the half/bf16 names) and refuse anything else:

    - optimizer/clip_grads.py ``clip_grad_by_total_norm_fp32`` (also imported by name
      into optimizer/optimizer.py);
    - optimizer/distrib_optimizer.py ``DistributedOptimizer._build_model_and_main_param_groups``
      and ``DistributedOptimizer.__init__``;
    - optimizer/optimizer.py ``Float16OptimizerWithFloat16Params.__init__``.

    Each runs with CPU tensors reporting CUDA type names, only for the call's duration."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    wrapped_clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped_clip
    optimizer.clip_grad_by_total_norm_fp32 = wrapped_clip
    dist_opt = distrib_optimizer.DistributedOptimizer
    build = dist_opt.__dict__["_build_model_and_main_param_groups"].__func__
    dist_opt._build_model_and_main_param_groups = classmethod(_with_cuda_type_names(build))  # type: ignore[assignment]
    dist_opt.__init__ = _with_cuda_type_names(dist_opt.__init__)  # type: ignore[method-assign]
    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _with_cuda_type_names(f16.__init__)  # type: ignore[method-assign]


def _patch_moe_split_sizes() -> None:
    """transformer/moe/token_dispatcher.py ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``
    (lines 876-893 in 0.16.1) turns the all-to-all split sizes into numpy arrays with
    moe/moe_utils.py ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which only converts a
    tensor that ``is_cuda``; on CPU the splits stay torch tensors, and
    ``ProcessGroup.all_to_all_single`` accepts only int sequences (a numpy array passes,
    a tensor raises ``TypeError``). We convert CPU tensors too, so the dispatcher hands
    gloo what it hands NCCL on a GPU: numpy split sizes (imported by name into the
    dispatcher, so both names are replaced)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        import torch

        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move
    token_dispatcher.maybe_move_tensor_to_cpu = move


def _patch_uneven_sequence_parallel_collectives() -> None:
    """tensor_parallel/mappings.py ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``
    (lines 144-151 and 184-192 in 0.16.1) take per-rank split sizes when the MoE all-to-all
    dispatcher gathers or scatters tokens over the tensor-parallel group under sequence
    parallelism (token_dispatcher.py:696 and 778): the pieces differ in length, and they
    call ``torch.distributed.all_gather`` / ``reduce_scatter`` with tensor lists of unequal
    sizes. NCCL's process group takes such lists; gloo's refuses them ("invalid tensor
    size"). On gloo we run the same reduction with equal pieces: the gather pads each piece
    to the longest and trims, the reduce-scatter all-reduces the whole and keeps this
    rank's rows (the same sums; more bytes, CPU only)."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_: Any, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    def scatter_uneven(input_: Any, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start: start + sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = scatter_uneven


PATCHES: tuple[Callable[[], None], ...] = (
    _patch_torch_cuda,
    _patch_hardcoded_cuda_tensors,
    _patch_tensor_type_checks,
    _patch_rng_tracker,
    _patch_torch_norm,
    _patch_moe_split_sizes,
    _patch_uneven_sequence_parallel_collectives,
)


# --------------------------------------------------------------------------- entry points


def _quiet_expected_warnings() -> None:
    """Warnings that are expected on a CPU machine and say nothing the user can act on."""
    import warnings

    for pattern in (r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed.*",
                    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
                    r".*full scope is deprecated.*",
                    r".*\.grad attribute of a Tensor that is not a leaf.*",
                    r".*`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)


def needed() -> bool:
    """True when megatron must run on the CPU: no CUDA device is usable."""
    import torch

    return not torch.cuda.is_available()


def apply(force: bool = False) -> list[str]:
    """Apply every patch once, when CUDA is absent (or ``force``). Returns the names of
    the patches in effect (empty when none were needed)."""
    if _applied:
        return list(_applied)
    if not (force or needed()):
        return []
    _quiet_expected_warnings()
    check_version()
    for patch in PATCHES:
        patch()
        _applied.append(patch.__name__.lstrip("_"))
    return list(_applied)


def applied() -> list[str]:
    """The patches in effect in this process."""
    return list(_applied)

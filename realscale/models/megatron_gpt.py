"""Build a megatron-core ``GPTModel`` for a :class:`~realscale.models.family.ModelArch`.

The local layer spec (plain torch layers; runs on CPU) is used unless Transformer Engine
is importable, in which case the TE spec is (GPU clusters). Model code takes its
parallel sizes as arguments and never asks which rank it is on.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING, Any

from realscale.errors import UserError
from realscale.models.family import ModelArch, rope_kwargs

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@functools.lru_cache(maxsize=None)
def te_status() -> tuple[bool, str]:
    """(usable, why not): Transformer Engine is installed, a GPU is present, and it imports
    (a TE built against another torch fails at import: an undefined symbol)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "is not installed"
    import torch

    if not torch.cuda.is_available():
        return False, "needs a CUDA GPU"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means the TE spec cannot be used
        return False, (f"is installed but does not import ({type(exc).__name__}: {str(exc)[:160]}); "
                       f"rebuild it against torch {torch.__version__}")
    return True, ""


def te_available() -> bool:
    return te_status()[0]


# Above this many tokens in a packed micro-batch, GPU runs without TE are refused. The local
# spec's attention is PackedSDPAttention (models/attention.py: per-sequence SDPA, no dense
# [T, T] mask any more), but it has never run on a GPU; until a GPU session measures its
# memory and speed at long rows, TE's fused attention stays the only long-row GPU path.
DENSE_ATTENTION_TOKENS = 8192


def check_attention_path(max_tokens: int, *, on_gpu: bool, use_te: bool) -> None:
    """A GPU run whose long micro-batches would go through the local spec's attention (not
    yet run on a GPU) refuses to start, in one line saying what to install."""
    if not on_gpu or use_te or max_tokens <= DENSE_ATTENTION_TOKENS:
        return
    why = te_status()[1] or "is turned off (use_te=false)"
    raise UserError(f"train.max_tokens_per_micro_batch={max_tokens} on GPUs needs Transformer Engine, which {why}: "
                    f"the local layer spec's packed attention has not been validated on GPUs above "
                    f"{DENSE_ATTENTION_TOKENS} tokens per micro-batch. Install it (pip install --no-build-isolation "
                    f"'transformer_engine[pytorch]', built against this torch) or set "
                    f"train.max_tokens_per_micro_batch<={DENSE_ATTENTION_TOKENS}")


RECOMPUTE = ("none", "selective", "full")


def recompute_kwargs(recompute: str) -> dict[str, Any]:
    """Megatron's activation-recomputation fields for ``recompute``.

    ``full``: every layer keeps only its input and recomputes its activations in the
    backward pass, one layer per checkpoint (``uniform`` method, ``recompute_num_layers=1``:
    the least memory; the planner's memory model, realscale/planner/cost.py, assumes
    exactly this). ``selective``: only core attention is recomputed. ``none``: nothing."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {}


def moe_kwargs(arch: ModelArch, ep: int, aux_loss_coef: float | None) -> dict[str, Any]:
    """megatron's MoE fields for ``arch`` (none for a dense model).

    Experts are megatron's ``SequentialMLP`` (one SwiGLU per local expert, no grouped GEMM:
    that needs a CUDA kernel), tokens travel between expert-parallel ranks by all-to-all
    (gloo has it, as NCCL does), and the expert tensor-parallel degree is megatron's
    default, the attention's tp. ``aux_loss_coef`` (None: the model's own
    ``router_aux_loss_coef``) weighs megatron's load-balancing loss; megatron's schedule
    scales its gradient by 1/micro-batches and DDP averages it over data-parallel ranks,
    so it is the mean over micro-batches and ranks of each micro-batch's auxiliary loss."""
    if arch.moe is None:
        if ep != 1:
            raise ValueError(f"ep={ep} needs a mixture-of-experts model; {arch.family.name} is dense")
        return {}
    moe = arch.moe
    if moe.num_experts % ep:
        raise ValueError(f"ep={ep} must divide the {moe.num_experts} experts")
    coef = moe.aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    if coef < 0:
        raise ValueError(f"the MoE auxiliary loss coefficient must be >= 0, got {coef}")
    return dict(num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.ffn_hidden_size,
                moe_router_score_function="softmax", moe_router_pre_softmax=not moe.norm_topk_prob,
                moe_router_load_balancing_type="aux_loss" if coef > 0 else "none", moe_aux_loss_coeff=coef,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, expert_model_parallel_size=ep)


def transformer_config(arch: ModelArch, *, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                       dtype: str = "float32", cpu_init: bool = True, recompute: str = "none", ep: int = 1,
                       moe_aux_loss_coef: float | None = None) -> TransformerConfig:
    """megatron ``TransformerConfig`` for this architecture and layout (``ep``: expert
    parallelism, a mixture-of-experts model only)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if arch.num_heads % tp or arch.num_kv_heads % tp:
        raise ValueError(f"tp={tp} must divide both num_heads ({arch.num_heads}) and num_kv_heads ({arch.num_kv_heads})")
    if arch.num_layers % pp:
        raise ValueError(f"pp={pp} must divide num_layers ({arch.num_layers})")
    if arch.moe is not None and tp > 1 and not sequence_parallel:
        # megatron's MoELayer.forward refuses to train with tp > 1 and no sequence
        # parallelism (transformer/moe/moe_layer.py:380 in 0.16.1): say so before any rank starts
        raise ValueError(f"a mixture-of-experts model with tp={tp} needs sequence parallelism "
                         "(parallel.sequence_parallel=true), as megatron's MoE layer requires")
    torch_dtype = getattr(torch, DTYPES[dtype])
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.family.qkv_bias, qk_layernorm=arch.family.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
        params_dtype=torch_dtype, pipeline_dtype=torch_dtype, bf16=dtype == "bfloat16", fp16=dtype == "float16",
        use_cpu_initialization=cpu_init, perform_initialization=True, **recompute_kwargs(recompute),
        **moe_kwargs(arch, ep, moe_aux_loss_coef),
    )


def layer_spec(arch: ModelArch, use_te: bool | None = None) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = te_available()
    experts = arch.moe.num_experts if arch.moe else None
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False,
                                                                qk_layernorm=arch.family.qk_norm)
    from realscale.models.attention import PackedSDPAttention

    spec = specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                          qk_layernorm=arch.family.qk_norm, normalization="RMSNorm")
    # packed sequences as THD, like the TE spec, instead of a dense [T, T] mask (models/attention.py)
    spec.submodules.self_attention.submodules.core_attention = PackedSDPAttention
    return spec


def build_gpt(arch: ModelArch, config: TransformerConfig, *, pre_process: bool, post_process: bool,
              use_te: bool | None = None, vocab_multiple: int = 128) -> Any:
    """One pipeline stage of the model (``pre_process``: holds the embedding;
    ``post_process``: holds the final norm and output layer)."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config, layer_spec(arch, use_te),
        vocab_size=arch.padded_vocab(config.tensor_model_parallel_size, vocab_multiple),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        **rope_kwargs(arch),
    )

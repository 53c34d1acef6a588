"""Worker functions for the megatron-on-CPU tests (spawned ranks import this module).

A small GPT (local layer spec: GQA, RoPE, RMSNorm, SwiGLU) is run through megatron's own
``get_forward_backward_func`` schedule. The reference is the same model in one process;
parallel runs load the reference's full weights into their shards and compare loss and
gradients (or updated weights) slice by slice.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB, SEQ, MBS = 96, 16, 2


def build_model(tp_sp: bool = False, pre: bool = True, post: bool = True) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core import parallel_state as ps

    cfg = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, bf16=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        sequence_parallel=tp_sp,
    )
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def make_batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen) for _ in range(n)]


def _forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand_as(inputs)
    output = model(inputs, positions, None, labels=labels)

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def run_schedule(model: Any, batches: list[torch.Tensor]) -> float | None:
    """Forward+backward over ``batches`` as micro-batches; mean loss on the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func()
    losses = fb(forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
    if not ps.is_pipeline_last_stage():
        return None
    return float(torch.stack([d["loss"] for d in losses]).mean())


def _setup(tp: int, pp: int, sp: bool) -> None:
    from realscale.parallel.megatron_state import Layout, init_megatron

    init_megatron(Layout(tp=tp, pp=pp, sequence_parallel=sp), seed=7)


def wrap_ddp(model: Any, dist_opt: bool = False) -> Any:
    """Megatron DDP, as training uses it: grads land in ``main_grad`` and
    ``finalize_model_grads`` reduces them over DP (and over TP for sequence-parallel
    norms, and across pipeline stages for tied embeddings)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    model.config.finalize_model_grads_func = finalize_model_grads
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=dist_opt)
    ddp = DistributedDataParallel(model.config, ddp_cfg, model)
    ddp.zero_grad_buffer()
    return ddp


def reference(num_batches: int) -> dict[str, Any]:
    """Single process: full weights, loss and full gradients."""
    from realscale.parallel import full_state

    _setup(1, 1, False)
    torch.manual_seed(0)
    model = build_model()
    weights = full_state.gather_full_single(model)
    ddp = wrap_ddp(model)
    loss = run_schedule(ddp, make_batches(num_batches))
    grads = full_state.gather_full_single(ddp, grads=True)
    return {"weights": weights, "loss": loss, "grads": grads}


def _max_rel(local: torch.Tensor, ref: torch.Tensor) -> float:
    return float((local - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def parallel_grads(tp: int, pp: int, sp: bool, ref: dict[str, Any], num_batches: int) -> dict[str, Any]:
    """This rank's loss and the worst relative gradient difference against ``ref``."""
    from realscale.parallel import full_state

    _setup(tp, pp, sp)
    model = build_model(tp_sp=sp)
    full_state.load_full(model, ref["weights"])
    ddp = wrap_ddp(model)
    loss = run_schedule(ddp, make_batches(num_batches))
    worst, checked = 0.0, 0
    for slot, grad in full_state.iter_local(ddp, grads=True):
        worst = max(worst, _max_rel(grad, ref["grads"][slot.key][slot.index]))
        checked += grad.numel()
    return {"loss": loss, "grad_rel": worst, "elements": checked}


def ddp_step(use_dist_opt: bool, ref_weights: dict[str, torch.Tensor] | None, num_batches: int) -> dict[str, Any]:
    """One Megatron DDP + (distributed) Adam step with grad clipping on the global batch
    split over the data-parallel ranks. Returns the updated full weights (rank 0 view),
    the grad norm, and the loss."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from realscale.parallel import full_state

    _setup(1, 1, False)
    torch.manual_seed(0)
    model = build_model()
    if ref_weights is None:
        ref_weights = full_state.gather_full_single(model)
    full_state.load_full(model, ref_weights)
    ddp = wrap_ddp(model, use_dist_opt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=0.05,
                                                 use_distributed_optimizer=use_dist_opt, bf16=False, fp16=False),
                                 [ddp])
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(num_batches)[rank::world]  # each DP rank its share of the global batch
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = run_schedule(ddp, batches)
    ok, grad_norm, _ = opt.step()
    loss_t = torch.tensor([loss])
    dist.all_reduce(loss_t)
    weights = full_state.gather_full_single(ddp)  # every DP rank holds the whole model
    return {"ok": bool(ok), "grad_norm": float(grad_norm), "loss": float(loss_t) / world,
            "weights": weights, "init": ref_weights}


def run_many(jobs: list[tuple[str, tuple]]) -> list[Any]:
    """Run several cases in one set of processes (spawning ranks costs seconds each)."""
    return [globals()[name](*args) for name, args in jobs]

"""The Megatron training engine (the policy's and the critic's; ARCHITECTURE.md, "A run").

One engine for CPU (gloo + :mod:`megatron_patches.cpu`, local layer spec) and GPUs
(NCCL, the Transformer Engine spec when installed). Every rank of the trainer builds a
:class:`MegatronEngine` after ``torch.distributed`` is up; the layout (tp, pp, dp) comes
from the config and the world size.

Packed sequences: a micro-batch is one row of back-to-back sequences, passed to the
model as THD (``PackedSeqParams`` with the row's ``cu_seqlens``, no mask) for both layer
specs: the TE spec's fused attention and, on the local spec (CPU, or GPUs without TE),
:class:`~realscale.models.attention.PackedSDPAttention`, which attends within each
sequence only. With TE, RoPE positions restart at each sequence (megatron's THD RoPE);
on the local spec they run over the whole row (``_packed_params`` says why), which gives
the same scores. The TE path was not run in this repository's CI (no GPU there).

Shared prefixes (``train.share_prefixes``, :mod:`realscale.models.shared_prefix`): on the
local spec with pp = 1 and a dense model, a micro-batch whose sequences share prefixes (a
group's prompt, answers' common starts) runs as a row of its distinct positions: each
row's RoPE table entry is its position in its sequence (``_stage_forward``), attention
reads a plan built from the layout in the packed parameters (:class:`~realscale.models.
attention.PlannedPackedParams`), and log-probs are computed once per distinct (row, next token)
pair and gathered back per token, so the loss functions see the usual per-token tensors.

Loss normalisation: ``train_step`` sums ``normalizer_fn`` over every micro-batch and
data-parallel rank first; the loss function divides by that global total, so the sum
of micro-batch losses is exactly the batch's token-mean (or seq-mean) loss whatever the
packing. Megatron divides each micro-batch loss by the number of micro-batches and DDP
averages over DP ranks; we multiply those factors back in.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist

from realscale.data.packing import pack_micro_batches
from realscale.models.convert import ExportGroups, export_hf_weights, load_hf_weights, save_hf
from realscale.models.family import load_arch
from realscale.models.megatron_gpt import build_gpt, check_attention_path, te_available, te_status, transformer_config
from realscale.models.shared_prefix import SharedRows, share_prefixes
from realscale.parallel.device import comm_device, comm_empty, cuda_usable, group_backend, local_device, to_comm
from realscale.parallel.megatron_state import Layout, init_megatron, rank_info
from realscale.parallel.model_spec import spec_from_hf_config
from realscale.train.batch import PackedBatch
from realscale.train.checkpoint import use_in_process_writer_queue
from realscale.train.logprobs import logprobs_from_hidden, next_token_targets

if TYPE_CHECKING:
    from realscale.config import Config

LossFn = Callable[[torch.Tensor, PackedBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
NormalizerFn = Callable[[PackedBatch], torch.Tensor]
# Statistics that are a micro-batch's share of a loss term normalised over the global batch
# (realscale.algo.losses, realscale.algo.value): the step's value is their sum, not their mean.
SUMMED_STATS = frozenset({"loss", "pg_loss", "kl", "value_loss"})
_KEPT = "_kept_outputs"  # train_step(keep=...): the forward's outputs, carried beside the loss's stats

log = logging.getLogger(__name__)


def masked_tokens(mb: PackedBatch) -> torch.Tensor:
    """Default normaliser: the number of loss-masked tokens (token-mean loss)."""
    mask = mb.fields.get("loss_mask")
    if mask is None:
        return torch.tensor(float(mb.num_tokens - mb.num_seqs), dtype=torch.float64)
    return mask.to(torch.float64).sum()


@dataclass
class EngineConfig:
    """What the engine needs, independent of the config tree (see :meth:`from_config`)."""

    model_path: str
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    dtype: str = "float32"
    seed: int = 1
    max_tokens_per_micro_batch: int = 4096
    logprob_chunk_tokens: int = 1024
    temperature: float = 1.0
    # optimizer (None lr: inference only)
    lr: float | None = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int = 1000
    distributed_optimizer: bool = True
    use_te: bool | None = None
    recompute: str = "none"  # none | selective | full (realscale.models.megatron_gpt.recompute_kwargs)
    ep: int = 1  # expert parallelism (a mixture-of-experts model)
    moe_aux_loss_coef: float | None = None  # None: the model's own router_aux_loss_coef
    # rollout routing replay: batches carrying "routed_experts" are routed as the servers did
    routing_replay: bool = False
    share_prefixes: bool = True  # realscale.models.shared_prefix; see MegatronEngine.share_prefixes

    @classmethod
    def from_config(cls, cfg: "Config", model_path: str, train: bool = True) -> "EngineConfig":
        o = cfg.optim
        return cls(model_path=model_path, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                   sequence_parallel=cfg.parallel.sequence_parallel, dtype=cfg.model.dtype, seed=cfg.run.seed,
                   max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
                   logprob_chunk_tokens=cfg.train.logprob_chunk_tokens, temperature=cfg.generate.temperature,
                   lr=o.lr if train else None, min_lr=o.min_lr, weight_decay=o.weight_decay,
                   adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                   warmup_steps=o.warmup_steps, schedule=o.schedule,
                   total_steps=max(1, cfg.run.total_steps * cfg.train.mini_batches),
                   distributed_optimizer=o.distributed_optimizer, recompute=resolve_recompute(cfg),
                   ep=cfg.parallel.ep,
                   moe_aux_loss_coef=None if cfg.train.moe_aux_loss_coef < 0 else cfg.train.moe_aux_loss_coef,
                   routing_replay=cfg.algo.routing_replay and train,  # the policy's, not a frozen reference's
                   share_prefixes=cfg.train.share_prefixes)


def resolve_recompute(cfg: Config) -> str:
    """``train.recompute``. ``auto`` is resolved before any process starts, by
    :func:`realscale.planner.apply.apply_plan` (to the recomputation ``parallel.plan``'s
    actor_train role was planned with); without a plan it means none."""
    if cfg.train.recompute != "auto":
        return cfg.train.recompute
    if cfg.parallel.plan:
        raise RuntimeError(f"train.recompute=auto with parallel.plan={cfg.parallel.plan} reached the engine "
                           "unresolved: realscale.planner.apply.apply_plan resolves it before the ranks start")
    return "none"


def micro_batch_plan(batch: PackedBatch, max_tokens: int) -> list[list[int]]:
    """Which sequences of ``batch`` each balanced micro-batch under ``max_tokens`` holds."""
    return [idx for idx in pack_micro_batches(batch.seqlens().tolist(), max_tokens, dp=1, multiple_of=1)[0] if idx]


def check_routing_replay(arch: Any, recompute: str) -> None:
    """Routing replay needs a mixture of experts, and no full recomputation: a forward
    recomputed in the backward pass would need Megatron's REPLAY_BACKWARD bookkeeping,
    which the engine does not drive."""
    if arch.moe is None:
        raise ValueError("algo.routing_replay: the policy has no experts to route (a dense model)")
    if recompute == "full":
        raise ValueError("algo.routing_replay with train.recompute=full: a recomputed forward would route again; "
                         "use recompute none or selective")


def split_to_count(plan: list[list[int]], seqlens: list[int], count: int) -> list[list[int]]:
    """``plan`` with its micro-batches split (the one with most tokens first, in two halves
    of about equal tokens) until it has ``count`` of them or every one holds one sequence."""
    plan = [list(idx) for idx in plan]
    while len(plan) < count:
        tokens = [sum(seqlens[i] for i in idx) if len(idx) > 1 else -1 for idx in plan]
        j = max(range(len(plan)), key=tokens.__getitem__)
        if tokens[j] < 0:
            break
        idx, acc, cut = plan[j], 0, 1
        for k in range(1, len(idx)):
            acc += seqlens[idx[k - 1]]
            cut = k
            if 2 * acc >= tokens[j]:
                break
        plan[j:j + 1] = [idx[:cut], idx[cut:]]
    return plan


def check_loaded(result: Any, ckpt_dir: str) -> None:
    """Refuse a checkpoint whose weights do not match the model. The load itself is
    non-strict only because Transformer Engine layers carry ``_extra_state`` entries that a
    checkpoint written with the local spec lacks (and the other way round); any other
    missing or unexpected key is a different model, which a silent load would train on."""
    bad = [k for k in (*result.missing_keys, *result.unexpected_keys) if not k.endswith("._extra_state")]
    if bad:
        raise RuntimeError(f"checkpoint {ckpt_dir} does not match this model ({len(bad)} weights differ, e.g. "
                           f"{', '.join(sorted(bad)[:3])}): it was written for another model or layout")


class MegatronEngine:
    """A megatron-core GPT model on this rank's layout, with optimizer and scheduler."""

    def __init__(self, ec: EngineConfig, *, shared_layout: bool = False) -> None:
        """``shared_layout``: megatron's groups are already up for this layout (a second
        model on the same ranks, e.g. the critic beside the actor); keep them."""

        self.ec = ec
        if not shared_layout:
            init_megatron(Layout(tp=ec.tp, pp=ec.pp, sequence_parallel=ec.sequence_parallel, ep=ec.ep), seed=ec.seed)
        self.ranks = rank_info(ec.sequence_parallel)
        self.arch = load_arch(ec.model_path)
        with open(os.path.join(ec.model_path, "config.json"), encoding="utf-8") as fh:
            self.hf_config = json.load(fh)
        self.use_te = te_available() if ec.use_te is None else ec.use_te
        on_gpu = cuda_usable()
        check_attention_path(ec.max_tokens_per_micro_batch, on_gpu=on_gpu, use_te=self.use_te)
        if on_gpu and not self.use_te and ec.use_te is None:  # said once, in the rank's log
            log.warning("Transformer Engine %s: the local (torch) layer spec is used", te_status()[1])
        config = transformer_config(self.arch, tp=ec.tp, pp=ec.pp, sequence_parallel=ec.sequence_parallel,
                                    dtype=ec.dtype, recompute=ec.recompute, ep=ec.ep,
                                    moe_aux_loss_coef=ec.moe_aux_loss_coef)
        config.variable_seq_lengths = ec.pp > 1  # packed micro-batches differ in length
        if ec.routing_replay:
            check_routing_replay(self.arch, ec.recompute)
            config.moe_enable_routing_replay = True  # each router gets a RouterReplay (router.py:206-207)
        self.config = config
        model = build_gpt(self.arch, config, pre_process=self.ranks.is_first_stage,
                          post_process=self.ranks.is_last_stage, use_te=self.use_te)
        etp = dist.get_world_size(self.ranks.etp_group) if self.ranks.etp_group is not None else ec.tp
        load_hf_weights(model, ec.model_path, self.arch, self.ranks.tp_rank, ec.tp, self.ranks.etp_rank, etp)
        self.device = local_device()
        self.model = model.to(self.device)
        self.ddp: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.step_count = 0
        self.share_prefixes = self._can_share_prefixes()
        self._layouts: dict[int, SharedRows | None] = {}
        if ec.lr is not None:
            self._build_optimizer()

    # ------------------------------------------------------------------ setup

    def _can_share_prefixes(self) -> bool:
        """``train.share_prefixes``, where it applies (the knob's help says where not)."""
        if not self.ec.share_prefixes:
            return False
        why = ("Transformer Engine's attention takes plain packed sequences" if self.use_te
               else "pp > 1: middle pipeline stages do not receive the tokens" if self.ec.pp > 1
               else "a mixture of experts: its load-balancing loss counts every sequence's tokens"
               if self.arch.moe is not None else None)
        if why is not None:
            log.info("train.share_prefixes: rows packed unshared (%s)", why)
        return why is None

    def _build_optimizer(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        ec = self.ec
        self.config.finalize_model_grads_func = finalize_model_grads
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=ec.distributed_optimizer)
        self.ddp = DistributedDataParallel(self.config, ddp_cfg, self.model)
        opt_cfg = OptimizerConfig(optimizer="adam", lr=ec.lr, min_lr=ec.min_lr, weight_decay=ec.weight_decay,
                                  adam_beta1=ec.adam_beta1, adam_beta2=ec.adam_beta2, adam_eps=ec.adam_eps,
                                  clip_grad=ec.clip_grad, use_distributed_optimizer=ec.distributed_optimizer,
                                  bf16=ec.dtype == "bfloat16", fp16=ec.dtype == "float16",
                                  params_dtype=self.config.params_dtype)
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.ddp])
        decay = "cosine" if ec.schedule == "cosine" else "constant"
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if ec.warmup_steps else ec.lr, max_lr=ec.lr,
            min_lr=ec.min_lr if decay == "cosine" else ec.lr, lr_warmup_steps=ec.warmup_steps,
            lr_decay_steps=max(ec.total_steps, ec.warmup_steps + 1), lr_decay_style=decay,
            start_wd=ec.weight_decay, end_wd=ec.weight_decay, wd_incr_steps=max(ec.total_steps, 1),
            wd_incr_style="constant")

    @property
    def module(self) -> Any:
        """The model as the schedule should see it (DDP-wrapped when training)."""
        return self.ddp if self.ddp is not None else self.model

    # ------------------------------------------------------------------ forward pieces

    def _layout(self, mb: PackedBatch) -> SharedRows | None:
        """The micro-batch's shared-prefix layout (built once per micro-batch and schedule),
        or None: sharing off, or nothing to share."""
        if not self.share_prefixes:
            return None
        if id(mb) not in self._layouts:
            shared = share_prefixes(mb.input_ids, mb.cu_seqlens)
            self._layouts[id(mb)] = shared if shared.num_rows < mb.num_tokens else None
        return self._layouts[id(mb)]

    def _row(self, mb: PackedBatch, shared: SharedRows | None = None) -> dict[str, torch.Tensor]:
        """One packed row for the model: tokens, positions (on the device), ``cu_seqlens``
        (THD, on the host: :meth:`_packed_params` reads it there). With a
        shared-prefix layout the row holds its rows, each at its position in its sequence,
        as one THD sequence (attention reads the layout)."""
        ids = mb.input_ids if shared is None else shared.row_ids
        pad = 0
        if self.ec.sequence_parallel and ids.numel() % self.ec.tp:
            pad = self.ec.tp - ids.numel() % self.ec.tp  # SP splits the row evenly over TP
        positions = torch.arange(ids.numel()) if shared is None else shared.positions
        if pad:  # the pad tokens: one more sequence of their own
            ids = torch.cat([ids, ids.new_zeros(pad)])
            positions = torch.cat([positions, torch.arange(pad)])
        cu = mb.cu_seqlens if shared is None else torch.tensor([0, shared.num_rows])
        row = {"tokens": ids[None], "positions": positions[None], "n": torch.tensor(mb.num_tokens)}
        if self.device.type != "cpu":
            row = {k: v.to(self.device) for k, v in row.items()}
        row["cu_seqlens"] = (torch.cat([cu, cu[-1:] + pad]) if pad else cu).cpu()  # on the host: _packed_params
        return row

    def _stage_forward(self, model: Any, row: dict[str, torch.Tensor], shared: SharedRows | None = None
                       ) -> torch.Tensor:
        """GPTModel.forward up to the final norm: the next stage's input, or on the last
        stage the final hidden states (log-probs are then computed in chunks from them,
        so the [T, V] logits never exist at once)."""
        gpt = model.module if hasattr(model, "module") else model
        packed = self._packed_params(row["cu_seqlens"], shared)
        pre = gpt._preprocess(input_ids=row["tokens"], position_ids=row["positions"], decoder_input=None,
                              inference_context=None, packed_seq_params=packed)
        decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset = pre[:5]
        if shared is not None and rotary_pos_emb is not None:
            # [rows, 1, 1, d] for positions 0..rows-1 (max_seqlen is the row's length) -> each
            # row's own sequence position; megatron applies a row-long table per row
            # (rope_utils.py:211-231, "CASE 1", megatron-core 0.16.1)
            rotary_pos_emb = rotary_pos_emb[row["positions"][0]]
        return gpt.decoder(hidden_states=decoder_input, attention_mask=None,
                           rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                           rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed,
                           sequence_len_offset=sequence_len_offset)

    def _replay_routing(self, model: Any, mb: PackedBatch) -> None:
        """Route this micro-batch's tokens to the experts the generation servers chose
        (``mb.fields["routed_experts"]``, ``[tokens, layers * top_k]``), in every MoE layer
        of this stage; a batch without them (a held-out evaluation) is routed as usual.

        Megatron's ``RouterReplay`` (transformer/moe/router_replay.py, 0.16.1) in
        ``REPLAY_FORWARD`` takes the given indices and gathers the router's own scores at
        them (``get_replay_topk``), so the weights of the chosen experts still come from
        the trainer's router and its gradient flows. Under sequence parallelism a rank's
        routers see its slice of the (padded) row, so the indices are sliced alike."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        gpt = model.module if hasattr(model, "module") else model
        routed = mb.fields.get("routed_experts")
        routers = [layer.mlp.router.router_replay for layer in gpt.decoder.layers]
        if routed is None:
            for replay in routers:
                replay.clear_indices()
                replay.clear_router_replay_action()
            return
        assert self.arch.moe is not None
        k = self.arch.moe.topk
        routed = routed.to(torch.long)
        if self.ec.sequence_parallel:
            pad = (-routed.shape[0]) % self.ec.tp  # _row pads the tokens the same way
            routed = torch.cat([routed, routed[-1:].expand(pad, -1)]) if pad else routed
            rows = routed.shape[0] // self.ec.tp
            routed = routed[self.ranks.tp_rank * rows:(self.ranks.tp_rank + 1) * rows]
        for layer, replay in zip(gpt.decoder.layers, routers):
            glob = int(layer.layer_number) - 1
            replay.clear_indices()  # one forward at a time: nothing is recomputed in backward
            replay.set_target_indices(routed[:, glob * k:(glob + 1) * k].to(self.device))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _packed_params(self, cu_seqlens: torch.Tensor, shared: SharedRows | None = None) -> Any:
        """Megatron's THD description of a packed row (``PackedSeqParams``) from its host-side
        ``cu_seqlens``: every length megatron wants as a Python int is read on the host, and
        the local spec's attention plan is built there and moved to the device once per
        micro-batch (no layer waits for the GPU to read an index back)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        from realscale.models.attention import PlannedPackedParams, attention_plan

        cu = cu_seqlens.to(torch.int32)
        total = int(cu[-1])
        if self.use_te:  # TE's kernels read the boundaries on the device
            longest = int((cu[1:] - cu[:-1]).max())
            cu = cu.to(self.device)
            return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                   max_seqlen_q=longest, max_seqlen_kv=longest)
        # PackedSDPAttention reads the plan; megatron's THD RoPE reads the *_padded
        # boundaries (attention.py:1081-1089). Given the whole row as one padded sequence,
        # RoPE rotates every token in one call at its row position instead of looping over
        # sequences in Python (rope_utils.py:214-238, ~25% of a CPU step): RoPE scores depend
        # only on distances within a sequence, so the result is the same as per-sequence
        # positions (the HF comparisons in tests/train check it). With a shared-prefix layout
        # the engine gives each row its own position instead (_stage_forward). The
        # boundaries stay on the host: nothing on this spec computes with them on the device,
        # and RoPE reads them back as Python ints in every layer (`.tolist()`, `.item()`,
        # rope_utils.py:204 and 218, megatron-core 0.16.1), each a wait for the GPU there.
        whole = torch.tensor([0, total], dtype=torch.int32)
        plan = attention_plan(cu, total, shared).to(self.device)
        return PlannedPackedParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=whole,
                                   cu_seqlens_kv_padded=whole, max_seqlen_q=total, max_seqlen_kv=total, plan=plan)

    def _output_weight(self, model: Any) -> torch.Tensor:
        gpt = model.module if hasattr(model, "module") else model
        if gpt.share_embeddings_and_output_weights:
            return gpt.shared_embedding_or_output_weight()
        return gpt.output_layer.weight

    def _token_logprobs(self, model: Any, hidden: torch.Tensor, mb: PackedBatch,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Aligned per-token log-probs (see :mod:`realscale.train.batch`) on the last stage."""
        from megatron.core import tensor_parallel

        if self.ec.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        else:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
        n = mb.num_tokens
        shared = self._layout(mb)
        hidden = hidden[:, 0]  # [rows, H]: drop the batch dim
        if shared is None:
            hidden = hidden[:n]  # drop SP padding
            targets, _ = next_token_targets(mb.input_ids.to(hidden.device), mb.cu_seqlens.to(hidden.device))
        else:  # each distinct (row, next token) pair once
            hidden = hidden[shared.pair_row.to(hidden.device)]
            targets = shared.pair_target.to(hidden.device)
        weight = self._output_weight(model)
        vocab_per_rank = weight.shape[0]
        lp, ent = logprobs_from_hidden(
            hidden, weight, targets, temperature=self.ec.temperature,
            vocab_start=self.ranks.tp_rank * vocab_per_rank, true_vocab_size=self.arch.vocab_size,
            tp_group=self.ranks.tp_group if self.ec.tp > 1 else None,
            chunk_tokens=self.ec.logprob_chunk_tokens, with_entropy=with_entropy)
        starts = mb.cu_seqlens[:-1].to(lp.device)
        keep = torch.ones(n, dtype=lp.dtype, device=lp.device)
        keep[starts] = 0.0  # first tokens have no prediction (the roll brings each sequence's last row there)
        if shared is None:
            align = lambda x: torch.roll(x, 1) * keep  # noqa: E731
        else:
            pair = shared.token_pair.to(lp.device)
            align = lambda x: x[pair] * keep  # noqa: E731
        return align(lp), (align(ent) if ent is not None else None)

    def _rows_run(self, mb: PackedBatch) -> int:
        """Positions the model ran for the micro-batch (fewer than its tokens when shared)."""
        shared = self._layouts.get(id(mb))
        return shared.num_rows if shared is not None else mb.num_tokens

    def _token_states(self, hidden: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        """``[T, H]`` final hidden states of the micro-batch's tokens (row j: the state after
        token j) from the stage's ``[rows, H]`` output."""
        shared = self._layout(mb)
        if shared is None:
            return hidden[:mb.num_tokens]
        return hidden[shared.token_rows.to(hidden.device)]

    def _trained_outputs(self, model: Any, hidden: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        """The per-token tensor :meth:`train_step` hands its loss function: the policy's
        aligned log-probs (a value model returns its values instead)."""
        return self._token_logprobs(model, hidden, mb)[0]

    def _micro_batches(self, batch: PackedBatch) -> tuple[list[PackedBatch], list[list[int]]]:
        """Balanced micro-batches under the token budget, and which sequences each holds.

        With expert parallelism every micro-batch's forward and backward exchange tokens
        with the other ranks of the expert-parallel group (all-to-all), so every data-parallel
        rank must run as many micro-batches as the busiest: micro-batches are split to
        reach that count, and where a rank has too few sequences, *fillers* (one short
        sequence again) are appended after ``len(plan)``: their outputs are dropped and
        their loss is multiplied by 0 (megatron's load-balancing loss still sees their
        tokens)."""
        plan = micro_batch_plan(batch, self.ec.max_tokens_per_micro_batch)
        if self.ranks.ep > 1 and self.ranks.dp > 1:
            count = to_comm(torch.tensor([len(plan)], dtype=torch.int64), group_backend(self.ranks.dp_group))
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.ranks.dp_group)
            busiest = int(count.cpu())
            plan = split_to_count(plan, batch.seqlens().tolist(), busiest)
            mbs = [batch.select(idx) for idx in plan]
            shortest = int(torch.argmin(batch.seqlens()))
            return mbs + [batch.select([shortest]) for _ in range(busiest - len(plan))], plan
        return [batch.select(idx) for idx in plan], plan

    def _run_schedule(self, mbs: list[PackedBatch], forward_only: bool,
                      loss_of: Callable[[Any, torch.Tensor, PackedBatch], tuple[torch.Tensor, dict[str, Any]]]
                      ) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        queue = iter(mbs)
        engine = self

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
            mb = next(data_iterator)
            if engine.ec.routing_replay:
                engine._replay_routing(model, mb)
            shared = engine._layout(mb)
            hidden = engine._stage_forward(model, engine._row(mb, shared), shared)
            return hidden, lambda out: loss_of(model, out, mb)

        self._layouts.clear()  # keyed by the micro-batches' ids: valid for one schedule
        max_len = max(mb.num_tokens for mb in mbs)
        if self.ec.sequence_parallel:
            max_len = math.ceil(max_len / self.ec.tp) * self.ec.tp
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=queue, model=[self.module], num_microbatches=len(mbs),
            seq_length=max_len, micro_batch_size=1, forward_only=forward_only)

    # ------------------------------------------------------------------ public API

    def logprobs(self, batch: PackedBatch, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Per-token log-probs (and entropy) of ``batch`` under the current weights, on
        every rank of this model replica."""
        def outputs(model: Any, hidden: torch.Tensor, mb: PackedBatch) -> dict[str, torch.Tensor]:
            lp, ent = self._token_logprobs(model, hidden, mb, with_entropy)
            return {"logprobs": lp} if ent is None else {"logprobs": lp, "entropy": ent}

        return self.forward_tokens(batch, outputs, ["logprobs"] + (["entropy"] if with_entropy else []))

    @torch.no_grad()
    def forward_tokens(self, batch: PackedBatch, outputs: Callable[[Any, torch.Tensor, PackedBatch],
                                                                    dict[str, torch.Tensor]],
                       keys: list[str]) -> dict[str, torch.Tensor]:
        """Forward-only pass: ``outputs(model, final hidden, micro-batch)`` on the last stage
        gives per-token tensors named ``keys``; returned in the batch's token order (fp32,
        CPU) on every rank of this model replica."""
        self.module.eval()
        mbs, plan = self._micro_batches(batch)

        def loss_of(model: Any, hidden: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, Any]]:
            out = {k: v.float().cpu() for k, v in outputs(model, hidden, mb).items()}
            return torch.zeros((), device=hidden.device), out

        results = self._run_schedule(mbs, True, loss_of)[:len(plan)]  # fillers' outputs dropped
        out = {}
        for key in keys:
            if self.ranks.is_last_stage:
                packed = self._unpermute(batch, plan, [r[key] for r in results])
            else:
                packed = torch.empty(batch.num_tokens, dtype=torch.float32)
            out[key] = self._from_last_stage(packed)
        return out

    def full_logits(self, batch: PackedBatch) -> torch.Tensor | None:
        """``[T, vocab]`` fp32 logits (row j predicts token j+1) on the last stage's
        ranks, ``None`` elsewhere. Materialises the whole vocabulary: for checks and
        small batches; training uses the chunked :meth:`logprobs`."""
        from megatron.core import tensor_parallel

        self.module.eval()
        mbs, plan = self._micro_batches(batch)

        def loss_of(model: Any, hidden: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, Any]]:
            if self.ec.sequence_parallel:
                hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden)
            logits = self._token_states(hidden[:, 0], mb).float() @ self._output_weight(model).float().t()
            if self.ec.tp > 1:
                backend = group_backend(self.ranks.tp_group)
                shards = [comm_empty(logits.shape, logits.dtype, backend) for _ in range(self.ec.tp)]
                dist.all_gather(shards, to_comm(logits, backend), group=self.ranks.tp_group)
                logits = torch.cat(shards, dim=1)
            return torch.zeros(()), {"logits": logits[:, : self.arch.vocab_size].cpu()}

        with torch.no_grad():
            results = self._run_schedule(mbs, True, loss_of)[:len(plan)]
        if not self.ranks.is_last_stage:
            return None
        return self._unpermute(batch, plan, [r["logits"] for r in results])

    @staticmethod
    def _unpermute(batch: PackedBatch, plan: list[list[int]], pieces: list[torch.Tensor]) -> torch.Tensor:
        """Micro-batch results back into the batch's own token order."""
        plan_cu = batch.cu_seqlens.tolist()
        out = torch.empty(batch.num_tokens, *pieces[0].shape[1:], dtype=torch.float32)
        for idx, piece in zip(plan, pieces):
            pos = 0
            for i in idx:
                n = plan_cu[i + 1] - plan_cu[i]
                out[plan_cu[i]: plan_cu[i] + n] = piece[pos: pos + n]
                pos += n
        return out

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.ec.pp == 1:
            return tensor
        t = to_comm(tensor, dist.get_backend())  # NCCL: collectives take tensors on this GPU
        dist.broadcast(t, src=self.ranks.last_stage_rank, group=self.ranks.pp_group)
        return t.cpu()

    def train_step(self, batch: PackedBatch, loss_fn: LossFn, normalizer_fn: NormalizerFn = masked_tokens,
                   keep: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step on this DP rank's share of the batch (all ranks call it).

        ``loss_fn(logp, micro_batch, normalizer)`` returns (loss, stats) where ``logp``
        are the aligned per-token log-probs with gradient and ``normalizer`` is the
        global total of ``normalizer_fn`` over every micro-batch and DP rank. With
        ``keep`` (a dict), the forward's per-token outputs, detached, are stored there as
        ``keep["outputs"]``: fp32 on the host, in the batch's token order, on every rank
        of this replica (as :meth:`logprobs` returns them; the weights they describe are
        those before this step).
        """

        if self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer (lr=None)")
        start = time.perf_counter()
        self.module.train()
        mbs, plan = self._micro_batches(batch)
        fillers = {id(mb) for mb in mbs[len(plan):]}
        local_norm = torch.stack([normalizer_fn(mb).double() for mb in mbs[:len(plan)]]).sum()
        total_norm = to_comm(local_norm.clone(), dist.get_backend())
        tokens = to_comm(torch.tensor([float(batch.num_tokens)], dtype=torch.float64), dist.get_backend())
        if self.ranks.dp > 1:
            dist.all_reduce(total_norm, group=self.ranks.dp_group)
            dist.all_reduce(tokens, group=self.ranks.dp_group)
        total_norm, tokens = total_norm.cpu(), tokens.cpu()
        normalizer = total_norm.float().clamp(min=1.0)
        scale = len(mbs) * self.ranks.dp  # undo megatron's 1/num_microbatches and DDP's 1/dp

        def loss_of(model: Any, hidden: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, Any]]:
            lp = self._trained_outputs(model, hidden, mb)
            loss, stats = loss_fn(lp, mb, normalizer.to(lp.device))
            reported = {k: v.detach().float().cpu() for k, v in stats.items()}
            reported["loss"] = loss.detach().float().cpu()
            if keep is not None:
                reported[_KEPT] = lp.detach().float().cpu()
            if id(mb) in fillers:  # runs forward and backward for the experts' exchanges only
                return loss * 0.0, reported
            return loss * scale, reported

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = self._run_schedule(mbs, False, loss_of)[:len(plan)]
        if keep is not None:
            kept = torch.empty(batch.num_tokens, dtype=torch.float32)
            if self.ranks.is_last_stage:
                kept = self._unpermute(batch, plan, [r.pop(_KEPT) for r in results])
            keep["outputs"] = self._from_last_stage(kept)
        rows = sum(self._rows_run(mb) for mb in mbs[:len(plan)])
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        self.step_count += 1
        stats = self._reduce_stats(results)
        stats.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                     lr=float(self.optimizer.param_groups[0]["lr"]), tokens=float(tokens),
                     micro_batches=float(len(plan)), time=time.perf_counter() - start, update_ok=float(bool(ok)),
                     row_fraction=rows / max(1, batch.num_tokens))
        return stats

    def _reduce_stats(self, results: list[dict[str, Any]]) -> dict[str, float]:
        """Loss terms (:data:`SUMMED_STATS`): summed over micro-batches and DP ranks (each
        is a share of the global mean); other stats: mean over micro-batches and ranks.
        Sent from the last stage."""

        keys = sorted(results[0]) if results else []
        if self.ec.pp > 1:
            holder = [keys]
            dist.broadcast_object_list(holder, src=self.ranks.last_stage_rank, group=self.ranks.pp_group)
            keys = holder[0]
        vec = torch.zeros(len(keys), dtype=torch.float64)
        if self.ranks.is_last_stage:
            for i, key in enumerate(keys):
                vals = torch.stack([r[key].double().reshape(()) for r in results])
                vec[i] = vals.sum() if key in SUMMED_STATS else vals.mean()
        vec = to_comm(vec, dist.get_backend())
        if self.ec.pp > 1:
            dist.broadcast(vec, src=self.ranks.last_stage_rank, group=self.ranks.pp_group)
        if self.ranks.dp > 1:
            dist.all_reduce(vec, group=self.ranks.dp_group)
        vec = vec.cpu()
        if self.ranks.dp > 1:
            for i, key in enumerate(keys):
                if key not in SUMMED_STATS:
                    vec[i] /= self.ranks.dp
        return {k: float(v) for k, v in zip(keys, vec)}

    # ------------------------------------------------------------------ checkpoints

    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        model_sd = self.model.sharded_state_dict()
        state = {"model": model_sd}
        if self.optimizer is not None:
            # "fully_reshardable" stores optimizer state per model tensor (gathered over DP on
            # save), so a checkpoint loads into any (tp, pp, dp) layout.
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        return state

    def _allocate_optimizer_state(self) -> None:
        """A fresh optimizer has no Adam state (nor 'step') until its first step, but
        loading needs the tensors to load into: megatron's own helper takes one zero-grad
        step to allocate them (the loaded values then replace them)."""
        if self.optimizer is None:
            return
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()

    def save(self, ckpt_dir: str, extra: dict[str, Any] | None = None) -> None:
        """Model, optimizer, scheduler, step and RNG (+ ``extra``, e.g. data position) into
        ``ckpt_dir`` with megatron's distributed checkpointing; every rank calls it. The
        directory is written under a temporary name and renamed when complete."""

        from megatron.core import dist_checkpointing, tensor_parallel

        use_in_process_writer_queue()  # not megatron's spawned manager process (see there)
        tmp = ckpt_dir.rstrip("/") + ".tmp"
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        state = self._sharded_state(loading=False)
        state["common"] = {
            "step_count": self.step_count,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "layout": {"tp": self.ec.tp, "pp": self.ec.pp, "dp": self.ranks.dp, "ep": self.ec.ep},
            "extra": extra or {},
        }
        dist_checkpointing.save(state, tmp)
        # RNG streams differ per rank (TP ranks seed their own), so they are not common state.
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        torch.save({"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()},
                   os.path.join(tmp, "rng", f"rank{dist.get_rank()}.pt"))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            os.replace(tmp, ckpt_dir)
        dist.barrier()

    def _check_expert_layout(self, ckpt_dir: str) -> None:
        """A mixture of experts' optimizer state is one optimizer under ep=1 and a chain of
        two (dense, experts) under ep > 1 (megatron's ``get_megatron_optimizer``), and their
        checkpoints name the state differently: loading across the two fails deep inside
        the checkpoint reader. Refused here in one line (tp, pp, dp and ep > 1 degrees may
        change; measured in tests/train/test_moe.py)."""
        from megatron.core import dist_checkpointing

        if self.arch.moe is None or self.optimizer is None:
            return
        saved = int(dist_checkpointing.load_common_state_dict(ckpt_dir)["common"]["layout"].get("ep", 1))
        if (saved > 1) != (self.ec.ep > 1):
            raise RuntimeError(f"checkpoint {ckpt_dir} was written with parallel.ep={saved}; this run has "
                               f"parallel.ep={self.ec.ep}: a mixture of experts' optimizer state loads only between "
                               "ep=1 layouts or between ep>1 layouts (megatron chains the experts' optimizer apart "
                               "under expert parallelism); resume with ep " + ("> 1" if saved > 1 else "= 1"))

    def load(self, ckpt_dir: str) -> dict[str, Any]:
        """Restore what :meth:`save` wrote, into this engine's layout (which may differ
        from the one that saved it). Returns the ``extra`` dict."""
        from megatron.core import dist_checkpointing, tensor_parallel

        if not os.path.isdir(ckpt_dir):
            raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
        self._check_expert_layout(ckpt_dir)
        self._allocate_optimizer_state()
        state = self._sharded_state(loading=True)
        state["common"] = None
        loaded = dist_checkpointing.load({k: v for k, v in state.items() if k != "common"}, ckpt_dir)
        common = dist_checkpointing.load_common_state_dict(ckpt_dir)["common"]
        check_loaded(self.model.load_state_dict(loaded["model"], strict=False), ckpt_dir)
        if self.optimizer is not None and "optimizer" in loaded:
            self.optimizer.load_state_dict(loaded["optimizer"])
            if common["scheduler"] is not None:
                self.scheduler.load_state_dict(common["scheduler"])
        self.step_count = int(common["step_count"])
        layout = common["layout"]
        if (layout["tp"], layout["pp"], layout["dp"]) == (self.ec.tp, self.ec.pp, self.ranks.dp):
            # RNG streams map 1:1 only within the same layout; elsewhere the seeds stand.
            rng = torch.load(os.path.join(ckpt_dir, "rng", f"rank{dist.get_rank()}.pt"), weights_only=False)
            torch.set_rng_state(rng["cpu"])
            tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        return dict(common["extra"])

    # ------------------------------------------------------------------ weights out

    def export_groups(self) -> Any:
        r = self.ranks
        moe = self.arch.moe is not None
        return ExportGroups(tp_group=r.tp_group if r.tp > 1 else None, pp_group=r.pp_group,
                            pp_ranks=r.pp_ranks, pp_rank=r.pp_rank,
                            is_sender_column=r.tp_rank == 0 and r.dp_rank == 0,
                            etp_group=r.etp_group if moe and dist.get_world_size(r.etp_group) > 1 else None,
                            ep_group=r.ep_group if moe and r.ep > 1 else None)

    def export_hf_weights(self, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None,
                          device: torch.device | str | None = None, stage_local: bool = False) -> Iterator[list]:
        """HF-named full tensors in buckets, yielded on global rank 0; every rank of the
        trainer must iterate it to the end (there are collectives inside). ``stage_local``:
        each pipeline stage's tensors yielded on that stage's first rank (tp and dp rank 0),
        nothing sent down the pipeline.

        ``device``: where the tensors are yielded; default the device the trainer's
        collectives use (its GPU under NCCL, the CPU under gloo), so a weight push hands
        an engine's NCCL group tensors on the GPU (vLLM 0.32's ``PyNcclCommunicator``
        asserts ``tensor.device == self.device``: ``pynccl.py:541``) and nothing is staged
        through host memory on the way. Writing to disk asks for ``"cpu"``."""

        if self.ranks.dp_rank != 0 and self.ranks.ep == 1:
            return iter(())  # with expert parallelism every rank takes part: its experts are gathered
        where = torch.device(device) if device is not None else comm_device(group_backend(None))
        cast = (lambda t: t.to(device=where, dtype=dtype)) if dtype is not None else (lambda t: t.to(where))
        return export_hf_weights(self.model, self.arch, self.export_groups(), self.ec.pp, bucket_bytes, cast,
                                 stage_local)

    def hf_weight_bytes(self) -> int:
        """Bytes of the full HF-named weights in the parameter dtype (what one whole copy
        of the model moves)."""

        itemsize = torch.empty((), dtype=self.config.params_dtype).element_size()
        return spec_from_hf_config(self.hf_config, itemsize=itemsize, vocab_multiple=1).param_bytes()

    def save_hf(self, out_dir: str) -> None:
        """Write an HF safetensors directory of the current weights (rank 0 writes)."""

        buckets = self.export_hf_weights(bucket_bytes=256 << 20, device="cpu")

        if dist.get_rank() == 0:
            save_hf(buckets, out_dir, self.hf_config)
            for name in os.listdir(self.ec.model_path):  # tokenizer and generation config travel along
                if name.startswith(("tokenizer", "special_tokens", "generation_config", "vocab", "merges",
                                     "chat_template")):
                    shutil.copy(os.path.join(self.ec.model_path, name), out_dir)
        else:
            for _ in buckets:
                pass

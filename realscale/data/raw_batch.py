"""Groups -> flat numpy arrays: the packing step the rollout process runs, without torch.

:func:`pack_raw` lays a step's accepted groups out as one :class:`RawBatch`, every
trajectory's prompt and output back to back (no padding): ``input_ids`` int64 ``[T]``,
``cu_seqlens`` int64 ``[N+1]``, per token ``loss_mask`` / ``behav_logprobs`` /
``versions`` float32 ``[T]`` (prompt tokens: mask 0, log-prob 0, version -1), one reward
per trajectory float32 ``[N]``, ``cu_groups`` int64 ``[G+1]`` (group ``g`` is
trajectories ``cu_groups[g]:cu_groups[g+1]``), and with ``algo.routing_replay`` the
experts of every position, int32 ``[T, layers * top_k]`` (:func:`routing_rows`).

What needs torch happens where torch is: trainer rank 0 turns a raw batch into the
trainer's ``PackedBatch``, advantages and all (:func:`realscale.train.actor.raw_to_batch`;
``groups_to_batch`` is the two steps in one process). The rollout process
(:mod:`realscale.rollout.process`) packs here and sends the arrays over its pipe as raw
bytes, so it never imports torch (1.1 CPU-seconds on the start-up's critical path).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from realscale.config import AlgoConfig
    from realscale.data.groups import Group, Trajectory


@dataclass
class RawBatch:
    """One step's groups as flat arrays (module docstring); ``routed_experts`` only with
    routing replay."""

    input_ids: np.ndarray  # int64 [T]
    cu_seqlens: np.ndarray  # int64 [N+1]
    loss_mask: np.ndarray  # float32 [T]
    behav_logprobs: np.ndarray  # float32 [T]
    versions: np.ndarray  # float32 [T]
    rewards: np.ndarray  # float32 [N], one per trajectory
    cu_groups: np.ndarray  # int64 [G+1]
    routed_experts: np.ndarray | None = None  # int32 [T, layers * top_k]

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays by name (``routed_experts`` left out when absent)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def pack_raw(groups: list["Group"], algo: "AlgoConfig") -> tuple[RawBatch, dict[str, float]]:
    """Accepted groups -> one :class:`RawBatch`, and rollout stats."""
    trajs = [t for g in groups for t in g]
    if not trajs:
        raise ValueError("cannot pack an empty list of sequences")
    n_prompt = np.array([len(t.prompt_ids) for t in trajs], dtype=np.int64)
    n_out = np.array([len(t.output_ids) for t in trajs], dtype=np.int64)
    cu = np.zeros(len(trajs) + 1, dtype=np.int64)
    np.cumsum(n_prompt + n_out, out=cu[1:])
    total = int(cu[-1])
    input_ids = np.empty(total, dtype=np.int64)
    mask = np.zeros(total, dtype=np.float32)
    behav = np.zeros(total, dtype=np.float32)
    versions = np.full(total, -1.0, dtype=np.float32)
    for t, start, mid, end in zip(trajs, cu[:-1].tolist(), (cu[:-1] + n_prompt).tolist(), cu[1:].tolist()):
        input_ids[start:mid] = t.prompt_ids
        input_ids[mid:end] = t.output_ids
        mask[mid:end] = t.loss_mask
        behav[mid:end] = t.output_logprobs
        versions[mid:end] = t.output_versions
    cu_groups = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum([len(g) for g in groups], out=cu_groups[1:])
    rewards = np.array([t.reward for t in trajs], dtype=np.float32)
    routed = routing_rows(trajs, cu) if algo.routing_replay else None
    raw = RawBatch(input_ids, cu, mask, behav, versions, rewards, cu_groups, routed)
    stats = {"reward/mean": _mean32(rewards), "reward/accuracy": _mean32(rewards > 0.5),
             "rollout/response_len": _mean32(n_out), "rollout/response_len_max": float(n_out.max()),
             "rollout/groups": float(len(groups)), "rollout/trajectories": float(len(trajs)),
             "rollout/interruptions": float(sum(t.num_interruptions for t in trajs)),
             "rollout/turns": sum(t.num_turns for t in trajs) / len(trajs)}
    return raw, stats


def _mean32(x: np.ndarray) -> float:
    """The mean as a float32 statistic, as torch's float32 mean gave it before the packing
    left torch: summed in float64, rounded once to float32 (the same value wherever
    torch's float32 sum was exact, as for 0/1 rewards and token counts; otherwise this
    one is the correctly rounded mean, torch's may be a float32 step off)."""
    return float(np.float32(x.mean(dtype=np.float64)))


def routing_rows(trajs: list["Trajectory"], cu_seqlens: np.ndarray) -> np.ndarray:
    """``[tokens, layers * top_k]`` int32 over the packed trajectories: the experts the
    generation server routed each position to (routing replay). The server reports every
    position but the last (the last sampled token is never fed); a trajectory's last row
    repeats the one before it (its output predicts nothing that is trained)."""
    widths = {t.routed_experts.size // (len(t.prompt_ids) + len(t.output_ids) - 1)
              for t in trajs if t.routed_experts is not None and t.routed_experts.size}
    if len(widths) != 1:
        raise ValueError(f"routing replay: the rollouts carry no routed experts, or routings of different widths "
                         f"({sorted(widths)} experts per position); are the generation servers reporting them?")
    width = widths.pop()
    out = np.empty((int(cu_seqlens[-1]), width), dtype=np.int32)
    for t, start, end in zip(trajs, cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        got = t.routed_experts
        if got is None or not got.size:
            raise ValueError(f"routing replay: trajectory {t.group_id!r} ({len(t.output_ids)} output tokens) has no "
                             "routed experts")
        if got.size % width:
            raise ValueError(f"routing replay: trajectory {t.group_id!r} has {got.size} routed experts, not a whole "
                             f"number of positions of {width}")
        rows = np.asarray(got).reshape(-1, width)
        if rows.shape[0] != end - start - 1:
            raise ValueError(f"routing replay: trajectory {t.group_id!r} has routing for {rows.shape[0]} positions, "
                             f"expected {end - start - 1} (prompt + output - 1)")
        out[start:end - 1] = rows  # cast to int32 as torch.as_tensor(..., dtype=int32) did
        out[end - 1] = rows[-1]
    return out

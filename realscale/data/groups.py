"""What a rollout produces: trajectories (one sampled answer or dialogue) and groups.

Token-level lists of a :class:`Trajectory` all run over the *output* tokens (everything
after the prompt), in order: model tokens have ``loss_mask`` 1 and the behaviour
log-prob and policy version the server reported; tokens the environment inserted in a
multi-turn episode (tool results, observations) have ``loss_mask`` 0 and log-prob 0, and
carry the version of the model turn before them so that they never lower a group's
``min_version``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Trajectory:
    """One sampled answer (or multi-turn dialogue) to one prompt, scored."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]  # behaviour log-probs, one per output token
    output_versions: list[int]  # policy version that produced each output token (-1: unknown)
    loss_mask: list[int]  # 1: model token (trained), 0: environment/tool token
    reward: float = 0.0
    reward_reason: str = "ok"
    finish_reason: str = ""
    group_id: str = ""  # the prompt's sample uid: every trajectory of a group shares it
    prompt_text: str = ""
    completion_text: str = ""
    num_turns: int = 1
    num_interruptions: int = 0  # weight updates the generation went through
    # routing replay: the experts each position 0 .. len(prompt) + len(output) - 2 was routed
    # to by the generation server (flat int32, positions x layers x top_k); None otherwise
    routed_experts: Any = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        for name in ("output_logprobs", "output_versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory {self.group_id!r}: {name} has {len(getattr(self, name))} "
                                 f"entries for {n} output tokens")

    @property
    def min_version(self) -> int | None:
        """The oldest known policy version among model tokens (None when there is none)."""
        versions = [v for v, m in zip(self.output_versions, self.loss_mask) if m and v >= 0]
        return min(versions) if versions else None


@dataclass
class Group:
    """The n trajectories sampled for one prompt, as the trainer consumes them."""

    trajectories: list[Trajectory]
    uid: str = ""  # the prompt's sample uid
    submit_version: int = 0  # controller version when the prompt was submitted
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):  # noqa: ANN204 - iterator of Trajectory
        return iter(self.trajectories)

    def __getitem__(self, i: int) -> Trajectory:
        return self.trajectories[i]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def min_version(self) -> int:
        """The oldest token version in the group; the submit version when no token has one
        (every answer empty), since nothing older can have shaped it."""
        versions = [v for v in (t.min_version for t in self.trajectories) if v is not None]
        return min(versions) if versions else self.submit_version

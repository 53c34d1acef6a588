"""Rewards: math answer checking (:class:`MathReward`) and sandboxed code tests (:class:`CodeReward`)."""

from realscale.reward.code_reward import CodeReward
from realscale.reward.math_reward import MathReward
from realscale.reward.result import RewardResult

__all__ = ["RewardResult", "MathReward", "CodeReward"]


def __getattr__(name: str):  # lazy: importing the package must not start sympy or pools
    if name == "MathReward":
        return MathReward
    if name == "CodeReward":
        return CodeReward
    raise AttributeError(name)

"""Rewards: math answer checking (:class:`MathReward`) and sandboxed code tests (:class:`CodeReward`)."""

from realscale.reward.result import RewardResult

__all__ = ["RewardResult", "MathReward", "CodeReward"]


def __getattr__(name: str):  # lazy: importing the package must not start sympy or pools
    if name == "MathReward":
        from realscale.reward.math_reward import MathReward

        return MathReward
    if name == "CodeReward":
        from realscale.reward.code_reward import CodeReward

        return CodeReward
    raise AttributeError(name)

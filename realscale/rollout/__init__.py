"""Asynchronous rollouts: the staleness rule, workflows (single/multi-turn), the controller."""

from realscale.rollout.controller import RolloutController, RolloutError, RolloutExhausted
from realscale.rollout.rewards import call_reward, reward_fn_for, routed_reward
from realscale.rollout.staleness import StalenessManager
from realscale.data.groups import Group, Trajectory
from realscale.rollout.workflows import (CalculatorEnv, EnvStep, MultiTurnWorkflow, SingleTurnWorkflow, Workflow,
                                         sampling_params_from_config, workflow_from_config)

__all__ = ["RolloutController", "RolloutError", "RolloutExhausted", "StalenessManager", "Group", "Trajectory",
           "Workflow", "SingleTurnWorkflow", "MultiTurnWorkflow", "CalculatorEnv", "EnvStep", "call_reward",
           "reward_fn_for", "routed_reward", "sampling_params_from_config", "workflow_from_config"]

"""Every knob of ``realscale config describe`` has a consumer: a knob nothing reads is a lie.

Design: a registry (:data:`CONSUMERS`) names, for every dotted key of
:func:`realscale.config.all_keys`, the function that reads it on a real code path, as
``"module:qualname"``. The test checks the registry against the code, both ways:

1. the registry holds exactly the schema's keys: a new knob fails here until its reader is
   named (a deliberate act, as torchtitan's frozen CLI surface makes it), and a removed
   knob fails until its entry goes;
2. the named function exists outside the config's own validation and its source reads the
   knob's leaf name (``cfg.algo.gamma``, ``a.gamma``, or ``getattr(cfg, "gamma")``);
3. the function is live: some other module of the package (or, for the few entry points
   listed in :data:`ENTRY_POINTS` with their reason, a command or test) refers to it.

Validation (``__post_init__``) is not a consumer: refusing a value is not using it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pathlib
import re
import textwrap

import pytest

from realscale.config import all_keys

ROOT = pathlib.Path(__file__).resolve().parents[1]

CONSUMERS: dict[str, str] = {
    # run
    "run.name": "realscale.config:run_dir",
    "run.output_dir": "realscale.config:run_dir",
    "run.seed": "realscale.train.engine:EngineConfig.from_config",
    "run.total_steps": "realscale.trainer:Trainer.train",
    "run.checkpoint_every": "realscale.trainer:Trainer._checkpoint_due",
    "run.export_every": "realscale.trainer:Trainer._export_due",
    "run.log_every": "realscale.trainer:Trainer._log",
    "run.tensorboard": "realscale.trainer:Trainer._start_driver",
    "run.wandb": "realscale.trainer:Trainer._start_driver",
    "run.wandb_mode": "realscale.trainer:Trainer._start_driver",
    # model
    "model.path": "realscale.sft:prepare_policy_model",
    "model.dtype": "realscale.train.engine:EngineConfig.from_config",
    "model.tokenizer": "realscale.rollout.factory:build_controller",
    "model.ref_path": "realscale.train.reference:reference_model_dir",
    # parallel
    "parallel.tp": "realscale.train.engine:EngineConfig.from_config",
    "parallel.pp": "realscale.train.engine:EngineConfig.from_config",
    "parallel.dp": "realscale.planner.apply:apply_plan",
    "parallel.sequence_parallel": "realscale.train.engine:EngineConfig.from_config",
    "parallel.ep": "realscale.train.engine:EngineConfig.from_config",
    "parallel.plan": "realscale.planner.apply:apply_plan",
    "parallel.backend": "realscale.trainer:Trainer.__init__",
    "parallel.mode": "realscale.trainer:Trainer.__init__",
    "parallel.release_idle_memory": "realscale.serve.colocated:ColocatedGeneration.__init__",
    "parallel.collective_timeout_s": "realscale.trainer:Trainer.__init__",
    # optim
    "optim.lr": "realscale.train.engine:EngineConfig.from_config",
    "optim.min_lr": "realscale.train.engine:EngineConfig.from_config",
    "optim.weight_decay": "realscale.train.engine:EngineConfig.from_config",
    "optim.adam_beta1": "realscale.train.engine:EngineConfig.from_config",
    "optim.adam_beta2": "realscale.train.engine:EngineConfig.from_config",
    "optim.adam_eps": "realscale.train.engine:EngineConfig.from_config",
    "optim.warmup_steps": "realscale.train.engine:EngineConfig.from_config",
    "optim.schedule": "realscale.train.engine:EngineConfig.from_config",
    "optim.clip_grad": "realscale.train.engine:EngineConfig.from_config",
    "optim.distributed_optimizer": "realscale.train.engine:EngineConfig.from_config",
    # train
    "train.max_tokens_per_micro_batch": "realscale.train.engine:EngineConfig.from_config",
    "train.mini_batches": "realscale.trainer:Trainer._next_batch",
    "train.logprob_chunk_tokens": "realscale.train.engine:EngineConfig.from_config",
    "train.share_prefixes": "realscale.train.engine:EngineConfig.from_config",
    "train.whole_groups": "realscale.trainer:Trainer._next_batch",
    "train.recompute": "realscale.train.engine:resolve_recompute",
    "train.moe_aux_loss_coef": "realscale.train.engine:EngineConfig.from_config",
    # algo
    "algo.adv_estimator": "realscale.train.actor:group_advantages",
    "algo.group_std_norm": "realscale.train.actor:group_advantages",
    "algo.normalize_adv_over_batch": "realscale.train.actor:update_policy",
    "algo.gamma": "realscale.train.critic:gae_advantages",
    "algo.lam": "realscale.train.critic:gae_advantages",
    "algo.eps_clip": "realscale.algo.losses:loss_kwargs_from_config",
    "algo.eps_clip_high": "realscale.algo.losses:loss_kwargs_from_config",
    "algo.dual_clip": "realscale.algo.losses:loss_kwargs_from_config",
    "algo.decoupled": "realscale.train.actor:update_policy",
    "algo.behav_imp_weight_cap": "realscale.algo.losses:loss_kwargs_from_config",
    "algo.behav_imp_weight_mode": "realscale.algo.losses:loss_kwargs_from_config",
    "algo.loss_agg": "realscale.algo.losses:loss_kwargs_from_config",
    "algo.kl_coef": "realscale.algo.losses:loss_kwargs_from_config",
    "algo.routing_replay": "realscale.rollout.controller:client_kwargs",
    "algo.kl_estimator": "realscale.algo.losses:loss_kwargs_from_config",
    # critic
    "critic.lr": "realscale.train.critic:critic_engine_config",
    "critic.value_clip": "realscale.train.critic:value_loss_fn",
    # rollout
    "rollout.batch_size": "realscale.rollout.controller:RolloutController.from_config",
    "rollout.n_samples": "realscale.rollout.workflows:workflow_from_config",
    "rollout.max_staleness": "realscale.rollout.controller:RolloutController.from_config",
    "rollout.max_concurrent": "realscale.rollout.controller:RolloutController.from_config",
    "rollout.max_ahead": "realscale.rollout.controller:RolloutController.from_config",
    "rollout.workflow": "realscale.rollout.workflows:workflow_from_config",
    "rollout.filter_all_equal": "realscale.rollout.controller:RolloutController.from_config",
    "rollout.max_turns": "realscale.rollout.workflows:workflow_from_config",
    "rollout.reward_timeout": "realscale.rollout.workflows:workflow_from_config",
    "rollout.max_consecutive_failures": "realscale.rollout.controller:RolloutController.from_config",
    "rollout.controller_process": "realscale.rollout.process:start_rollouts",
    "rollout.processes": "realscale.rollout.sharded:start_sharded",
    # generate
    "generate.backend": "realscale.launcher.roles:generation_server",
    "generate.num_servers": "realscale.launcher.local:LocalBackend.start_servers",
    "generate.host": "realscale.launcher.local:LocalBackend.start_servers",
    "generate.max_new_tokens": "realscale.rollout.workflows:sampling_params_from_config",
    "generate.temperature": "realscale.rollout.workflows:sampling_params_from_config",
    "generate.top_p": "realscale.rollout.workflows:sampling_params_from_config",
    "generate.top_k": "realscale.rollout.workflows:sampling_params_from_config",
    "generate.pause_mode": "realscale.trainer:Trainer.__init__",
    "generate.weight_update": "realscale.publish.publisher:transport_for",
    "generate.request_timeout": "realscale.rollout.controller:client_kwargs",
    "generate.control_timeout_s": "realscale.rollout.controller:client_kwargs",
    "generate.max_running_requests": "realscale.launcher.local:LocalBackend.start_servers",
    "generate.tp": "realscale.inference.vllm_server:vllm_command",
    "generate.ep": "realscale.inference.sglang_launcher:sglang_command",
    "generate.cpu_threads": "realscale.inference.vllm_server:vllm_env",
    "generate.vllm_kv_cache_mb": "realscale.inference.vllm_server:vllm_command",
    "generate.vllm_enforce_eager": "realscale.inference.vllm_server:vllm_command",
    "generate.vllm_weight_engine": "realscale.inference.vllm_server:vllm_command",
    "generate.context_length": "realscale.launcher.local:LocalBackend.start_servers",
    "generate.mem_fraction_static": "realscale.inference.sglang_launcher:sglang_command",
    # data
    "data.source": "realscale.data.dataset:from_config",
    "data.size": "realscale.data.dataset:from_config",
    "data.shuffle": "realscale.data.dataset:from_config",
    "data.max_prompt_tokens": "realscale.data.dataset:from_config",
    "data.task_max_operand": "realscale.tasks.arith:task_from_config",
    "data.task_ops": "realscale.tasks.arith:task_from_config",
    "data.task_heldout": "realscale.tasks.arith:task_from_config",
    "data.task_worked_fraction": "realscale.sft:_batches_for",
    "data.task_seed": "realscale.tasks.arith:task_from_config",
    "data.task_min_steps": "realscale.tasks.long_tail:LongTailTask.from_config",
    "data.task_max_steps": "realscale.tasks.long_tail:LongTailTask.from_config",
    "data.task_tail_alpha": "realscale.tasks.long_tail:LongTailTask.from_config",
    # reward
    "reward.kind": "realscale.rollout.rewards:reward_fn_for",
    "reward.timeout": "realscale.reward.math_reward:MathReward.from_config",
    "reward.workers": "realscale.reward.math_reward:MathReward.from_config",
    "reward.max_answer_chars": "realscale.reward.math_reward:MathReward.from_config",
    "reward.code_concurrency": "realscale.reward.code_reward:CodeReward.from_config",
    "reward.code_memory_mb": "realscale.reward.code_reward:CodeReward.from_config",
    "reward.code_disk_mb": "realscale.reward.code_reward:CodeReward.from_config",
    "reward.code_python": "realscale.reward.code_reward:CodeReward.from_config",
    "reward.code_sandbox_allow_weaker": "realscale.reward.code_reward:CodeReward.from_config",
    "reward.code_uid_base": "realscale.reward.code_reward:CodeReward.from_config",
    "reward.code_judge_url": "realscale.reward.judge:JudgeClient.from_config",
    # sft
    "sft.base_model": "realscale.sft:build_base_model",
    "sft.hidden_size": "realscale.sft:build_base_model",
    "sft.num_layers": "realscale.sft:build_base_model",
    "sft.num_heads": "realscale.sft:build_base_model",
    "sft.num_kv_heads": "realscale.sft:build_base_model",
    "sft.intermediate_size": "realscale.sft:build_base_model",
    "sft.num_experts": "realscale.sft:build_base_model",
    "sft.experts_per_token": "realscale.sft:build_base_model",
    "sft.steps": "realscale.sft:_train_rank",
    "sft.batch_size": "realscale.sft:_train_rank",
    "sft.lr": "realscale.sft:_train_rank",
    "sft.warmup_steps": "realscale.sft:_train_rank",
    "sft.output": "realscale.sft:sft_output_dir",
    "sft.eval_size": "realscale.sft:run_sft",
    "eval.data": "realscale.eval.benchmark:settings_from_config",
    "eval.k": "realscale.eval.benchmark:settings_from_config",
    "eval.max_new_tokens": "realscale.eval.benchmark:settings_from_config",
    "eval.max_problems": "realscale.eval.benchmark:settings_from_config",
    "eval.samples": "realscale.eval.benchmark:settings_from_config",
    "eval.temperature": "realscale.eval.benchmark:settings_from_config",
    "eval.top_p": "realscale.eval.benchmark:settings_from_config",
    "eval.before": "realscale.launcher.supervisor:_start_accuracy",
    "eval.after": "realscale.launcher.supervisor:_final_accuracy",
    "generate.timeout_slack": "realscale.rollout.controller:client_kwargs",
    "run.keep_checkpoints": "realscale.trainer:Trainer.__init__",
    "run.pin_checkpoints": "realscale.trainer:Trainer.__init__",
    "sft.data": "realscale.sft:_batches_for",
    "sft.max_seq_len": "realscale.sft:_batches_for",
    "sft.stages": "realscale.sft:stage_plan",
    # launch
    "launch.backend": "realscale.launcher:backend_for",
    "launch.nodes": "realscale.launcher.render:render_sbatch",
    "launch.gpus_per_node": "realscale.launcher.render:render_sbatch",
    "launch.gpu": "realscale.launcher.render:problem_for",
    "launch.gen_fraction": "realscale.launcher.render:plan_for",
    "launch.model_size": "realscale.launcher.render:model_spec_for",
    "launch.time": "realscale.launcher.render:render_sbatch",
    "launch.partition": "realscale.launcher.render:render_sbatch",
    "launch.account": "realscale.launcher.render:render_sbatch",
    "launch.cpus_per_task": "realscale.launcher.render:render_sbatch",
    "launch.ntasks": "realscale.launcher.render:render_sbatch",
    "launch.signal_seconds": "realscale.launcher.render:render_sbatch",
    "launch.requeue": "realscale.launcher.supervisor:stopped_early",
    "launch.check_shared_storage": "realscale.launcher.slurm:SlurmBackend.prepare",
    "launch.health_timeout": "realscale.launcher.slurm:SlurmBackend.start_servers",
    "launch.server_restarts": "realscale.launcher.slurm:SlurmBackend.start_servers",
    "launch.python": "realscale.launcher.render:render_sbatch",
    "launch.nccl": "realscale.launcher.slurm:SlurmBackend.__init__",
    "launch.env": "realscale.launcher.slurm:SlurmBackend.__init__",
    "launch.sbatch_extra": "realscale.launcher.render:render_sbatch",
    "launch.oversubscribe": "realscale.planner.validate:check_capacity",
}

# Consumers that nothing else in the package calls, and why that is still a real path.
ENTRY_POINTS: dict[str, str] = {
}


def _resolve(target: str) -> tuple[object, str]:
    module_name, qualname = target.split(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj, module_name


def _reads(fn: object, leaf: str) -> bool:
    """Does ``fn``'s source read attribute ``leaf`` (or name it as a string, getattr-style)?"""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    return any((isinstance(n, ast.Attribute) and n.attr == leaf)
               or (isinstance(n, ast.Constant) and n.value == leaf) for n in ast.walk(tree))


@functools.lru_cache(maxsize=1)
def _package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in (ROOT / "realscale").rglob("*.py")}


def test_every_knob_has_a_registered_consumer() -> None:
    keys = set(all_keys())
    missing = sorted(keys - set(CONSUMERS))
    stale = sorted(set(CONSUMERS) - keys)
    assert not missing, (f"knobs with no registered consumer: {missing}; name the function that reads each in "
                         "tests/test_knobs.py CONSUMERS, or remove the knob")
    assert not stale, f"CONSUMERS names keys the config no longer has: {stale}"


@pytest.mark.parametrize("key", sorted(CONSUMERS))
def test_consumer_reads_the_knob(key: str) -> None:
    fn, module_name = _resolve(CONSUMERS[key])
    qualname = CONSUMERS[key].split(":")[1]
    assert not qualname.endswith("__post_init__"), f"{key}: validation is not a consumer"
    leaf = key.split(".")[-1]
    assert _reads(fn, leaf), f"{key}: {CONSUMERS[key]} does not read '{leaf}'"


@pytest.mark.parametrize("target", sorted(set(CONSUMERS.values())))
def test_consumer_is_live(target: str) -> None:
    """Some other place in the package refers to the consumer (by its own name or, for a
    method, its class's), so the knob reaches a run rather than dead code."""
    if target in ENTRY_POINTS:
        return
    module_name, qualname = target.split(":")
    names = [qualname.split(".")[0], qualname.split(".")[-1]]
    own = module_name.replace(".", "/") + ".py"
    own_init = module_name.replace(".", "/") + "/__init__.py"
    for path, text in _package_sources().items():
        body = text
        if path in (own, own_init):  # in its own module, a use beyond the definition counts
            body = re.sub(rf"(def|class) ({'|'.join(map(re.escape, names))})\b", "", text)
        if any(re.search(rf"\b{re.escape(n)}\b", body) for n in names if not n.startswith("__")):
            return
        if names[-1] == "__init__" and re.search(rf"\b{re.escape(names[0])}\(", body):
            return
    pytest.fail(f"{target}: nothing in realscale/ refers to it; the knobs it reads reach no run")

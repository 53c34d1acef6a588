"""The supervisor of a run (``realscale train``): prepare, start, watch, report.

1. **prepare**: apply the plan (``parallel.plan``), resolve the config and write it into
   the run directory, make the policy model (the ``realscale sft`` warm start when the
   recipe asks for it: its ranks started by the same backend as the trainer's),
   evaluate it on the held-out split.
2. **start**: the generation servers, then the trainer ranks (``rank_main`` of
   :mod:`realscale.trainer`) through a backend: local processes, or Slurm job steps inside an allocation.
3. **watch**: one failing process stops the others; SIGUSR1 (Slurm's notice before the
   time limit, or a pre-emption) asks the ranks to checkpoint and exit, then the job is
   requeued; SIGTERM / Ctrl-C stop everything.
4. **report**: evaluate the HF export the trainer ranks wrote after the last step
   (``<run>/final``; a run that finished without one fails, loudly), plot, print a summary.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any, Callable

from realscale.config import Config, run_dir, save_config
from realscale.errors import LaunchError
from realscale.eval import evaluate_heldout
from realscale.eval.benchmark import paired_change
from realscale.inference.sglang_launcher import check_sglang_version
from realscale.launcher import Backend, backend_for, clear_stop, ranks_backend, request_stop, served, stop_reason
from realscale.metrics import MetricsLogger, plot_run, summary_text
from realscale.parallel.device import cuda_usable
from realscale.planner.apply import apply_plan
from realscale.sft import prepare_policy_model
from realscale.train.checkpoint import checkpoint_name, disk_usage, final_dir, latest_checkpoint, read_final_export


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


RankEntry = Callable[[dict[str, Any], str, list[str], str], None]


def train(cfg: Config, rank_entry: RankEntry) -> int:
    """The supervisor: prepare, start servers and trainer ranks (on this machine or as
    Slurm job steps, see realscale/launcher/), watch, report. ``rank_entry`` is what each
    trainer rank runs (:func:`realscale.trainer.rank_main`; the command wires it, so the
    launcher never imports the loop)."""
    previous_usr1 = signal.getsignal(signal.SIGUSR1)
    try:
        return _supervise(cfg, rank_entry)
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)


def _supervise(cfg: Config, rank_entry: RankEntry) -> int:
    cfg = apply_plan(cfg)
    out_dir = run_dir(cfg)
    os.makedirs(out_dir, exist_ok=True)
    try:
        if cfg.generate.backend == "sglang":  # refuse an unsupported SGLang before anything starts
            check_sglang_version()
        backend = backend_for(cfg, out_dir)
        backend.prepare()  # under Slurm: is the run directory on storage every node shares?
    except LaunchError as exc:
        print(f"realscale: {exc}", flush=True)
        return 1
    clear_stop(out_dir)  # the request that stopped an earlier (requeued) run is done with
    # USR1: Slurm's notice before the time limit (--signal=B:USR1@secs) or pre-emption
    signal.signal(signal.SIGUSR1, lambda *_: request_stop(out_dir, "requeue"))
    save_config(cfg, out_dir)
    t0 = time.time()
    try:
        model_dir = prepare_policy_model(cfg, out_dir, ranks_backend)
    except LaunchError as exc:  # a rank of the warm start failed: its traceback is in its log
        print(f"realscale: {exc}", flush=True)
        return 1
    if cfg.algo.kl_coef:  # a reference of another architecture: one line now, not a rank's traceback later
        from realscale.train.reference import reference_model_dir  # (imports torch)

        reference_model_dir(cfg, model_dir)
    start_accuracy = _start_accuracy(cfg, model_dir, out_dir)
    acc_start = None
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the run like Ctrl-C
    code = 0
    try:
        if stop_reason(out_dir) is None:  # a stop requested while preparing: start nothing
            # colocated: the trainer ranks generate themselves (realscale/serve/colocated.py)
            # The ranks start while the servers do (imports and engine builds overlap); the
            # servers' rollouts wait for them (realscale/rollout/process.py), and a server that
            # fails to come up still ends the run here, before any step.
            colocated = cfg.parallel.mode == "colocated"
            urls = [] if colocated else backend.start_servers(model_dir, asdict(cfg), wait=False)
            backend.start_ranks(rank_entry, cfg.parallel.world_size, (asdict(cfg), model_dir, urls, out_dir))
            if not colocated:
                backend.servers_ready()
            acc_start = start_accuracy()  # (its failure stops the run now, not after the last step)
            code = backend.wait()
    except KeyboardInterrupt:
        print("\nrealscale: interrupted; stopping trainer ranks and generation servers")
        code = 130
    except LaunchError as exc:
        print(f"realscale: {exc}", flush=True)
        code = 1
    finally:
        backend.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a late notice must not kill the final evaluation
    reason = stop_reason(out_dir)
    done = (latest_checkpoint(out_dir) or "").endswith(checkpoint_name(cfg.run.total_steps))
    if code == 0 and reason is not None and not done:  # (a request after the last step changes nothing)
        return stopped_early(cfg, backend, out_dir, reason)
    if code != 0:
        print(f"realscale: a process of the run failed (exit code {code}); logs under {out_dir}")
        return code
    try:
        acc_end = _final_accuracy(cfg, out_dir)
    except LaunchError as exc:
        print(f"realscale: {exc}", flush=True)
        return 1
    if acc_start is None:  # (nothing was started: the run was done, or stopped while preparing)
        acc_start = start_accuracy()
    hist_path = os.path.join(out_dir, "staleness_hist.json")
    hist = {int(k): v for k, v in json.load(open(hist_path)).items()} if os.path.exists(hist_path) else {}
    extra = {"total time": f"{time.time() - t0:.0f} s"}
    disk = disk_usage(out_dir)
    extra["disk use"] = (f"{_size(disk['disk/run_bytes'])} (checkpoints {_size(disk['disk/checkpoints_bytes'])}, "
                         f"weight versions {_size(disk['disk/weights_bytes'])}; {_size(disk['disk/free_bytes'])} free)")
    extra.update(accuracy_lines(acc_start, acc_end, out_dir))
    if acc_end is not None:
        log = MetricsLogger(out_dir, 0, progress=False)
        record = {f"eval/{k}": v for k, v in acc_end.items()}
        record["eval/accuracy"] = acc_end.get("greedy", next(iter(acc_end.values())))
        record.update({f"eval/start_{k}": v for k, v in (acc_start or {}).items()})
        log.log(cfg.run.total_steps, record)
        log.close()
    plot_run(out_dir, hist)
    print(summary_text(out_dir, extra))
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump({"accuracy_start": acc_start, "accuracy_end": acc_end, "seconds": time.time() - t0,
                   "staleness_hist": hist, "disk": disk}, fh, indent=1)
    return 0


def accuracy_lines(acc_start: dict[str, float] | None, acc_end: dict[str, float] | None,
                   out_dir: str) -> dict[str, str]:
    """The summary's held-out lines: each score before -> after (with its 95% interval when the
    evaluation gave one), the calculator use of multi-turn runs, and the paired change of
    avg@n when both evaluations left per-problem records (``<run>/eval_start``, ``eval_final``)."""
    lines: dict[str, str] = {}
    for kind in dict.fromkeys([*(acc_start or {}), *(acc_end or {})]):
        if kind.startswith("tool_use_") or kind.endswith("_ci95"):
            continue
        label = f"held-out accuracy ({kind})" if kind in ("greedy", "sampled") else f"held-out {kind}"
        lines[label] = f"{_with_ci(acc_start, kind)} -> {_with_ci(acc_end, kind)}"
        if acc_start and f"tool_use_{kind}" in acc_start:  # multi-turn: episodes the calculator answered in
            lines[f"held-out calculator use ({kind})"] = (f"{_pct(acc_start[f'tool_use_{kind}'])} -> "
                                                          f"{_pct(acc_end and acc_end.get(f'tool_use_{kind}'))}")
    change = paired_change(os.path.join(out_dir, "eval_start"), os.path.join(out_dir, "eval_final"))
    if change is not None:
        name, diff, half = change
        lines[f"held-out {name} change (paired)"] = f"{100 * diff:+.1f} ± {100 * half:.1f} points (95%)"
    return lines


def _with_ci(acc: dict[str, float] | None, kind: str) -> str:
    """``"42.2%"``, or ``"42.2% ± 5.4"`` where the evaluation gave a 95% interval."""
    text = _pct((acc or {}).get(kind))
    half = (acc or {}).get(f"{kind}_ci95")
    return text if half is None else f"{text} ± {100 * half:.1f}"


def _start_accuracy(cfg: Config, model_dir: str, out_dir: str) -> Callable[[], dict[str, float] | None]:
    """The held-out accuracy of the starting model (``<run>/eval_start.json``; a resumed
    run reads the first run's), as a function that waits for it. On CPU, without a
    benchmark's servers (``eval.data``), it is computed on a thread beside the servers'
    and the trainer ranks' start-up (imports, engines: ~15 s on the default recipe, much of
    it on one core), with one torch thread so as not to oversubscribe the cores they get.
    On GPUs it runs first, before anything starts: the device it would use is a trainer
    rank's."""
    path = os.path.join(out_dir, "eval_start.json")
    accuracy: Future[dict[str, float] | None] = Future()
    if not cfg.eval.before:  # the summary says "n/a -> ..." and gives no paired change
        accuracy.set_result(None)
        return accuracy.result
    if latest_checkpoint(out_dir) is not None and os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            accuracy.set_result(json.load(fh))
        return accuracy.result

    def compute() -> dict[str, float] | None:
        acc = _heldout(cfg, model_dir, os.path.join(out_dir, "eval_start"))
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:  # whole or absent: a resume reads it
            json.dump(acc, fh)
        os.replace(tmp, path)
        return acc

    import torch

    if cfg.eval.data or cuda_usable():
        accuracy.set_result(compute())
        return accuracy.result

    def on_thread() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            accuracy.set_result(compute())
        except BaseException as exc:  # noqa: BLE001 - raised again where the supervisor waits for it
            accuracy.set_exception(exc)
        finally:
            torch.set_num_threads(threads)

    threading.Thread(target=on_thread, name="eval-start", daemon=True).start()
    return accuracy.result


def stopped_early(cfg: Config, backend: Backend, out_dir: str, reason: str) -> int:
    """The ranks checkpointed and exited on a stop request: requeue the Slurm job (it
    resumes from that checkpoint), or say how to resume a local run."""
    ckpt = latest_checkpoint(out_dir)
    print(f"realscale: stopped on request ({reason}); last checkpoint {ckpt or 'none'}", flush=True)
    if reason == "requeue" and cfg.launch.requeue:
        backend.requeue()
    return 0


def _size(n: float) -> str:
    """Bytes as people read them (MiB below a GiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _final_accuracy(cfg: Config, out_dir: str) -> dict[str, float] | None:
    """The held-out evaluation of the trainer ranks' HF export of the last step
    (``<run>/final``; None with ``eval.after=false``); LaunchError when the ranks finished
    without writing it (checked either way)."""
    if latest_checkpoint(out_dir) is None:
        return None
    record = read_final_export(out_dir)
    if record is None or record.get("step") != cfg.run.total_steps:
        held = "none" if record is None else f"one of step {record.get('step')}"
        raise LaunchError(f"the trainer ranks finished without exporting step {cfg.run.total_steps} to "
                          f"{final_dir(out_dir)} ({held}); the checkpoint {latest_checkpoint(out_dir)} is intact: "
                          "run the same command again to export it")
    if not cfg.eval.after:
        return None
    return _heldout(cfg, final_dir(out_dir), os.path.join(out_dir, "eval_final"))


def _heldout(cfg: Config, model_dir: str, out_dir: str) -> dict[str, float] | None:
    """The held-out evaluation; a benchmark (``eval.data``) samples from servers started for it."""
    if not cfg.eval.data:
        return evaluate_heldout(cfg, model_dir, out_dir)
    with served(cfg, model_dir, out_dir) as urls:
        return evaluate_heldout(cfg, model_dir, out_dir, urls)


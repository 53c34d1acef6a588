"""GPU verification in one command (issue 33): what one GPU can check of realscale, in 8 minutes.

NOT YET RUN ON A GPU. Its CPU dry run (``--device cpu --quick``) is in the default test
tier (tests/scripts/test_gpu_check.py), so it cannot rot between GPU runs.

On the GPU machine (one H100/H200, Python 3.12, its own CUDA torch, no internet, no
Transformer Engine, SGLang or vLLM), from a copy of the repository whose ``.whl/`` holds
what ``bash scripts/gpu_check_wheels.sh`` downloaded (megatron-core and the few pure-Python
packages that machine lacks)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:. python3 scripts/gpu_check.py --out $OUT

(``.whl/`` is git-ignored through ``.git/info/exclude``: a copy of the repository made from
what git tracks must take ``.whl/`` along explicitly.)
It ends within ``--budget`` seconds (470 by default), so give the command about 9 minutes.

Everything lands in ``--out``: ``gpu_check.json`` (every item: status ok / failed /
skipped, the reason, its figures and checks), ``gpu_check.txt`` (a short table) and
``gpu_check.log`` (the processes' output, tail). Large files (model directories, the
kernel build, the end-to-end run) go to ``--scratch`` (a temporary folder by default,
removed at the end), never to ``--out``.

The items, each with its own time budget; one failing, hanging or crashing never loses
the others' figures (they run in a worker process that is restarted after a crash or a
timeout, each item inside try/except; the end-to-end run is a process of its own):

a. ``engine``: the Megatron engine (``MegatronEngine``, local layer spec, no TE) on the
   device: tiny-qwen2 and small-qwen2 at fp32 and bf16; per-token log-probs against HF
   transformers' on the same device (max |diff|), one PPO train step (the policy moves).
b. ``layer_stack``: a 1.5B-class layer stack: Qwen2-1.5B's real widths (hidden 1536, 12
   heads, 2 KV heads, MLP 8960) but ``--stack-layers`` layers (default 4 of the real 28:
   building and loading 28 layers from random weights would take minutes of the eight)
   and the project's byte-level vocabulary (264 tokens, not 151,936: the output layer is
   not what is measured), random weights; packed sequences; train-step tokens/s and MFU
   against this GPU's bf16 peak, measured in the same run with an 8192^3 matmul.
c. ``kernels``: ``csrc/cuda/*.cu`` (and ``csrc/*.cpp``) built there with nvcc through
   setup.py's own extension list (``setup.py build_ext``, into the scratch folder, in the
   background from the start), then the CUDA kernels against their Python twins: equal
   outputs, throughput. On CPU: skipped; the same comparison runs on the C++ CPU kernels
   when they are built, so the comparison code is exercised.
d. ``collectives``: an NCCL world of one through ``realscale.parallel.device``
   (``init_distributed``, ``backend``, ``comm_device``, ``to_comm``): a collective on the
   communication device, the weight export (each exported tensor's device: the export
   must not leave the GPU), the batch scatter, a colocated publish (the generation
   layout's weights hash-equal to the trainer's after each publish, weights changed in
   between), and the device-contract helper if ``realscale/parallel/device.py`` has one
   by then. On CPU: skipped (NCCL needs CUDA); the same checks run on gloo.
e. ``server``: the embedded server (``EmbeddedServer``) on the device: decode tokens/s at
   batch 1, 16 and 64, and the latency of ``/pause_generation`` (retract and abort)
   while a batch decodes.
f. ``e2e``: ``realscale train`` in colocated mode (the trainer generates, an NCCL world of
   one) for a few steps of the tiny recipe (configs/tiny_cpu.yaml: the warm start first)
   on the device; the reward per step, held-out accuracy before and after, and that the
   generation side used the trainer's weights after every publish (``train/behav_kl``:
   behaviour log-probs from generation against the trainer's proximal ones, ~0 only if
   the published weights equal the trainer's; the direct hash check is in d).
g. ``not_run`` in the JSON: what could not run, and why.

``--quick`` shrinks every item (small models, few tokens, two RL steps of an untrained
model, the end-to-end run beside the worker) so that the CPU dry run takes about two
minutes on two cores. Exit code: 0 when every item is ok or skipped, 1 when one failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ITEMS = ("env", "engine", "layer_stack", "kernels", "collectives", "server", "e2e")
STATUSES = ("ok", "failed", "skipped")
# Seconds each item may take at most (the worker is killed past it; then the next item runs).
BUDGETS = {"env": 60, "engine": 110, "collectives": 70, "server": 70, "layer_stack": 110, "kernels": 70,
           "e2e": 220}
QUICK_BUDGETS = {"env": 60, "engine": 150, "collectives": 120, "server": 100, "layer_stack": 100, "kernels": 60,
                 "e2e": 240}
TOTAL_S = 470.0  # the 8 minutes, less a margin
QUICK_TOTAL_S = 330.0
# Full mode: what the first worker stage leaves for the end-to-end run and the second stage
E2E_RESERVE_S = 200.0
SECOND_STAGE_RESERVE_S = 50.0
WORKER_START_S = 120.0  # a worker that has not begun its first item by then is stuck
KERNEL_BUILD_S = 300.0
LOG_TAIL_BYTES = 4 << 20


# ====================================================================== results


class Item:
    """One item's record: figures, named checks (a failed one fails the item), what it
    could not run. The figures gathered before an exception stay in the record."""

    def __init__(self, name: str, budget: float, partial: Path | None = None) -> None:
        self.name, self.budget, self.partial = name, budget, partial
        self.start = time.monotonic()
        self.figures: dict[str, Any] = {}
        self.checks: dict[str, dict[str, Any]] = {}
        self.not_run: list[dict[str, str]] = []
        self.summary = ""
        self.skip_reason = ""

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()

    def check(self, name: str, ok: bool, detail: Any = None) -> bool:
        self.checks[name] = {"ok": bool(ok), "detail": _plain(detail)}
        if self.partial is not None:  # what a kill or a crash after this point leaves behind
            _write_json(self.partial, self.record())
        return bool(ok)

    def skip_part(self, what: str, why: str) -> None:
        self.not_run.append({"what": f"{self.name}: {what}", "why": why})

    def skip(self, why: str) -> None:
        """The item as a whole is skipped (its figures, if any, are kept)."""
        self.skip_reason = why

    def record(self, error: str | None = None) -> dict[str, Any]:
        failed = [k for k, c in self.checks.items() if not c["ok"]]
        if error is not None:
            status, reason = "failed", error
        elif failed:
            status, reason = "failed", "checks failed: " + "; ".join(
                f"{k} ({self.checks[k]['detail']})" if self.checks[k]["detail"] is not None else k for k in failed)
        elif self.skip_reason:
            status, reason = "skipped", self.skip_reason
        else:
            status, reason = "ok", ""
        return {"status": status, "reason": reason, "seconds": round(self.elapsed(), 2), "budget_s": self.budget,
                "summary": self.summary, "figures": _plain(self.figures), "checks": self.checks,
                "not_run": self.not_run}


def _plain(x: Any) -> Any:
    """JSON-able: tensors and numpy scalars to floats/lists, NaN to a string."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if hasattr(x, "tolist"):
        return _plain(x.tolist())
    return str(x)


def validate_report(report: dict[str, Any], device: str = "cpu") -> list[str]:
    """What is wrong with a report's form: a missing item or status, an item reported ok
    without figures or checks or with a failed check, a skip or failure without a reason.
    (Whether the figures are good is each item's checks'.)"""
    problems = []
    items = report.get("items", {})
    for name in ITEMS:
        rec = items.get(name)
        if rec is None:
            problems.append(f"{name}: missing")
            continue
        if rec.get("status") not in STATUSES:
            problems.append(f"{name}: status {rec.get('status')!r}")
            continue
        if rec["status"] != "ok" and not rec.get("reason"):
            problems.append(f"{name}: {rec['status']} without a reason")
        if rec["status"] == "ok":
            if not rec.get("figures"):
                problems.append(f"{name}: ok without figures")
            if name != "env" and not rec.get("checks"):
                problems.append(f"{name}: ok without checks")
            bad = [k for k, c in rec.get("checks", {}).items() if not c.get("ok")]
            if bad:
                problems.append(f"{name}: ok with failed checks {bad}")
    if not isinstance(report.get("not_run"), list):
        problems.append("not_run: missing")
    return problems


# ====================================================================== helpers (worker side)


class Ctx:
    """What every item of a worker shares."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.quick = args.quick
        self.scratch = Path(args.scratch)
        self.device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.backend: str | None = None

    def dist(self) -> str:
        """torch.distributed as a world of one, through the project's helper (NCCL on a GPU)."""
        if self.backend is None:
            from realscale.parallel.device import init_distributed

            self.backend = init_distributed("auto")
        return self.backend

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    def build_done(self) -> bool:
        return (self.scratch / "kernels_build.json").exists()


def _model(name: str) -> str:
    from realscale.models.tiny import resolve_model_path

    return resolve_model_path(name)


def _rl_batch(vocab: int, n: int, lo: int, hi: int, seed: int = 1) -> Any:
    """Packed sequences with the fields a PPO loss reads (the first 2 tokens masked out)."""
    import torch

    from realscale.train.batch import PackedBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    seqs = [torch.randint(0, vocab, (m,), generator=gen) for m in lengths]
    mask = [torch.cat([torch.zeros(2), torch.ones(m - 2)]) for m in lengths]
    behav = [-3.0 + 0.5 * torch.randn(m, generator=gen) for m in lengths]
    adv = [torch.full((m,), float(torch.randn((), generator=gen))) for m in lengths]
    return PackedBatch.from_sequences(seqs, {"loss_mask": mask, "behav_logprobs": behav, "advantages": adv})


def _ppo_loss(logp: Any, mb: Any, normalizer: Any) -> Any:
    """The trainer's own decoupled PPO loss (it moves the batch's fields to the log-probs' device)."""
    from realscale.config import AlgoConfig
    from realscale.train.actor import ppo_loss_fn

    return ppo_loss_fn(AlgoConfig())(logp, mb, normalizer)


def _hf_logprobs(model_dir: str, batch: Any, dtype: Any, device: Any) -> Any:
    """HF transformers' per-token log-probs of ``batch`` (the engine's alignment: 0 at
    each sequence's first token), each sequence on its own, on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for i in range(batch.num_seqs):
            s = batch.sequence(i).to(device)
            logp = torch.log_softmax(model(s[None]).logits[0].float(), dim=-1)
            out.append(torch.cat([torch.zeros(1, device=device), logp[:-1].gather(1, s[1:, None])[:, 0]]).cpu())
    del model
    return torch.cat(out)


def _post_json(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[float, Any]:
    """POST ``body``; (seconds, decoded reply)."""
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return time.perf_counter() - start, json.loads(raw or b"null")


# ====================================================================== items


def item_env(it: Item, ctx: Ctx) -> None:
    import importlib.metadata as md
    import importlib.util

    import torch

    f = it.figures
    f.update(python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
             torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(), device=str(ctx.device),
             cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads())
    for pkg in ("megatron-core", "transformers", "tokenizers", "safetensors", "omegaconf", "aiohttp", "numpy",
                "math-verify", "setuptools", "ninja"):
        try:
            f[f"version/{pkg}"] = md.version(pkg)
        except md.PackageNotFoundError:
            f[f"version/{pkg}"] = None
    for mod in ("transformer_engine", "sglang", "vllm", "flash_attn", "apex"):
        f[f"present/{mod}"] = importlib.util.find_spec(mod) is not None
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        f.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                 multiprocessors=p.multi_processor_count)
        try:
            f["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - a figure, not a check
            f["nccl"] = f"unknown ({exc})"
    nvcc = _nvcc()
    f["nvcc"] = ((_run_text([nvcc, "--version"]).strip().splitlines() or ["?"])[-1]) if nvcc else None
    f["git_head"] = _run_text(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).strip() or None
    it.summary = f"{f.get('gpu', 'cpu')}, torch {f['torch']}, megatron-core {f['version/megatron-core']}"


def item_engine(it: Item, ctx: Ctx) -> None:
    import torch

    from realscale.train.engine import EngineConfig, MegatronEngine

    ctx.dist()
    models = ["tiny-qwen2"] if ctx.quick else ["tiny-qwen2", "small-qwen2"]
    # fp32: the same math as HF up to summation order; bf16: rounding of the weights and
    # activations in both (tiny random models have flat log-probs, so the spread is given too)
    tol = {"float32": 1e-4 if not ctx.cuda else 1e-3, "bfloat16": 0.1}
    n, lo, hi, budget = (6, 5, 18, 32) if ctx.quick else (12, 8, 96, 256)
    lines = []
    for name in models:
        for dt in ("float32", "bfloat16"):
            case = f"{name}/{dt}"
            if it.left() < 0.25 * it.budget:
                it.skip_part(case, "the item's time budget was spent")
                continue
            path = _model(name)
            t0 = time.perf_counter()
            eng = MegatronEngine(EngineConfig(model_path=path, dtype=dt, lr=1e-3, max_tokens_per_micro_batch=budget,
                                              logprob_chunk_tokens=64, clip_grad=1.0, total_steps=10, use_te=False))
            build_s = time.perf_counter() - t0
            batch = _rl_batch(eng.arch.vocab_size, n, lo, hi)
            ctx.sync()
            t0 = time.perf_counter()
            lp = eng.logprobs(batch)["logprobs"]
            ctx.sync()
            lp_s = time.perf_counter() - t0
            syncs = _sync_count(ctx, lambda: eng.logprobs(batch))
            ref = _hf_logprobs(path, batch, getattr(torch, dt), ctx.device)
            keep = torch.ones(batch.num_tokens, dtype=torch.bool)
            keep[batch.cu_seqlens[:-1]] = False
            diff = float((lp - ref)[keep].abs().max())
            gen = torch.Generator().manual_seed(2)
            batch.fields["behav_logprobs"] = lp + 0.1 * torch.randn(lp.shape, generator=gen)
            stats = eng.train_step(batch, _ppo_loss)
            ctx.sync()
            lp1 = eng.logprobs(batch)["logprobs"]
            moved = float((lp1 - lp)[keep].abs().max())
            param = next(eng.model.parameters())
            r = {"max_abs_diff_vs_hf": diff, "tol": tol[dt], "ref_logprob_std": float(ref[keep].std()),
                 "tokens": batch.num_tokens, "build_s": build_s, "logprobs_s": lp_s, "param_device": str(param.device),
                 "param_dtype": str(param.dtype), "train_loss": stats["loss"], "train_grad_norm": stats["grad_norm"],
                 "train_step_s": stats["time"], "micro_batches": stats["micro_batches"],
                 "update_ok": stats["update_ok"], "logprob_change_after_step": moved,
                 "logprobs_syncs": syncs, "layers": eng.arch.num_layers}
            it.figures[case] = r
            it.check(f"{case}: log-probs vs HF", diff <= tol[dt], f"max|diff| {diff:.3g} > {tol[dt]}"
                     if diff > tol[dt] else None)
            it.check(f"{case}: on the device", param.device.type == ctx.device.type, str(param.device))
            it.check(f"{case}: train step", stats["update_ok"] == 1.0 and math.isfinite(stats["grad_norm"])
                     and stats["grad_norm"] > 0 and moved > 0,
                     {"update_ok": stats["update_ok"], "grad_norm": stats["grad_norm"], "moved": moved})
            lines.append(f"{case} |d|={diff:.1e}")
            del eng
            ctx.free()
    if not it.figures:
        raise RuntimeError("no engine case ran")
    it.summary = ", ".join(lines)


def _sync_count(ctx: Ctx, fn: Callable[[], Any]) -> int | None:
    """How many times ``fn`` made the host wait for the GPU (``torch.cuda.set_sync_debug_mode``
    warns at each synchronizing call); None on CPU. A figure, not a check: the attention
    plan is meant to keep it independent of the number of layers."""
    if not ctx.cuda:
        return None
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def _peak_matmul(ctx: Ctx, dtype: Any) -> dict[str, float]:
    """The device's measured dense matmul rate in ``dtype`` (TFLOP/s, mean of timed runs)."""
    import torch

    n = (8192 if ctx.cuda else (512 if ctx.quick else 1024))
    reps, warm = (10, 3) if ctx.cuda else (5, 1)
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    for _ in range(warm):
        a @ b
    ctx.sync()
    times = []
    for _ in range(3):  # three timed rounds of `reps` products; the fastest round is the peak
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        ctx.sync()
        times.append((time.perf_counter() - t0) / reps)
    del a, b
    secs = min(times)
    return {"n": n, "dtype": str(dtype), "tflops": 2 * n**3 / secs / 1e12, "seconds_per_matmul": secs,
            "rounds_s": times}


def item_layer_stack(it: Item, ctx: Ctx) -> None:
    import torch

    from realscale.models.tiny import build_tiny_model
    from realscale.train.engine import EngineConfig, MegatronEngine

    ctx.dist()
    dtype_name = "bfloat16" if ctx.cuda else "float32"  # bf16 matmuls on a CPU are not what a CPU runs
    peak = _peak_matmul(ctx, getattr(torch, dtype_name))
    it.figures["peak"] = peak
    if ctx.quick:
        dims = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 384}
        max_len, total, mb_tokens, steps = 96, 384, 192, 1
    else:
        dims = {"hidden_size": 1536, "num_layers": ctx.args.stack_layers, "num_heads": 12, "num_kv_heads": 2,
                "intermediate_size": 8960}
        max_len, total, mb_tokens, steps = 2048, 32768, 4096, 3
    it.figures["dims"] = dict(dims, note="Qwen2-1.5B widths, %d of its 28 layers, byte-level vocabulary"
                              % dims["num_layers"] if not ctx.quick else "a shrunken stack (--quick)")
    t0 = time.perf_counter()
    path = build_tiny_model(str(ctx.scratch / "models" / "stack"), family="qwen2", **dims)
    it.figures["write_model_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng = MegatronEngine(EngineConfig(model_path=path, dtype=dtype_name, lr=1e-5, max_tokens_per_micro_batch=mb_tokens,
                                      logprob_chunk_tokens=mb_tokens, clip_grad=1.0, total_steps=100, use_te=False))
    it.figures["build_s"] = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    lengths: list[int] = []
    while total - sum(lengths) >= max_len // 4:
        lengths.append(int(torch.randint(max_len // 4, min(max_len, total - sum(lengths)) + 1, (1,), generator=gen)))
    seqs = [torch.randint(0, eng.arch.vocab_size, (m,), generator=gen) for m in lengths]
    from realscale.train.batch import PackedBatch

    batch = PackedBatch.from_sequences(seqs, {
        "loss_mask": [torch.cat([torch.zeros(2), torch.ones(m - 2)]) for m in lengths],
        "behav_logprobs": [torch.full((m,), -math.log(eng.arch.vocab_size)) for m in lengths],
        "advantages": [torch.full((m,), float(torch.randn((), generator=gen))) for m in lengths]})
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    eng.train_step(batch, _ppo_loss)  # warm-up (allocator, kernels)
    ctx.sync()
    t0 = time.perf_counter()
    stats = [eng.train_step(batch, _ppo_loss) for _ in range(steps)]
    ctx.sync()
    secs = (time.perf_counter() - t0) / steps
    after = _peak_matmul(ctx, getattr(torch, dtype_name))  # again: a busy machine can slow one measurement
    if after["tflops"] > peak["tflops"]:
        peak = after
    it.figures["peak"] = peak
    tokens = batch.num_tokens
    hidden, layers = dims["hidden_size"], dims["num_layers"]
    matmul_params = sum(p.numel() for n_, p in eng.model.named_parameters() if "decoder" in n_ and p.dim() == 2)
    matmul_params += eng.arch.vocab_size * hidden  # the output projection
    attn = 6 * layers * hidden * sum(m * m for m in lengths)  # (2 s^2 d QK^T + 2 s^2 d AV) / 2 (causal) x 3
    flops = 6 * matmul_params * tokens + attn
    achieved = flops / secs / 1e12
    f = it.figures
    f.update(dtype=dtype_name, sequences=len(lengths), tokens=tokens, micro_batch_tokens=mb_tokens,
             step_s=secs, tokens_per_s=tokens / secs, matmul_params=matmul_params, model_tflop_per_step=flops / 1e12,
             achieved_tflops=achieved, mfu=achieved / peak["tflops"], losses=[s["loss"] for s in stats],
             grad_norms=[s["grad_norm"] for s in stats],
             flops_note="model FLOPs: 6 x matmul parameters x tokens + causal attention within each sequence; the "
                        "local spec computes attention densely over each packed micro-batch row (masked), so the "
                        "hardware does more than this")
    if ctx.cuda:
        f["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        f["kernel_build_running"] = not ctx.build_done()
    it.check("train steps finite and applied", all(s["update_ok"] == 1.0 and math.isfinite(s["loss"]) for s in stats),
             [s["update_ok"] for s in stats])
    # (on a GPU an MFU above 1 would be a measuring error; a shared CPU's peak varies too much to say)
    it.check("throughput measured", tokens / secs > 0 and 0 < f["mfu"] and (f["mfu"] < 1.2 or not ctx.cuda),
             {"mfu": f["mfu"]})
    it.summary = (f"{tokens / secs:,.0f} tok/s, MFU {100 * f['mfu']:.1f}% of a measured {peak['tflops']:.1f} TFLOP/s "
                  f"({dtype_name}, {layers} layers x {hidden})")
    del eng
    ctx.free()


def compare_kernels(it: Item, ctx: Ctx, cuda: bool) -> None:
    """The compiled kernels (CUDA ones when ``cuda``) against their Python twins on the
    device: equal outputs and throughput. A kernel that is not built is recorded so."""
    import torch

    from realscale import kernels
    from realscale.algo.gae import gae_torch
    from realscale.parallel.intervals import gather_fallback, scatter_fallback

    dev = ctx.device if cuda else torch.device("cpu")
    where = "cuda" if cuda else "cpu"
    big = cuda and not ctx.quick

    def timed(fn: Callable[[], Any], reps: int) -> float:
        fn()
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ctx.sync()
        return (time.perf_counter() - t0) / reps

    gen = torch.Generator().manual_seed(0)
    mod = kernels.load("gae", cuda=cuda)
    if mod is None:
        it.figures[f"gae_{where}"] = {"built": False}
        it.check(f"gae_{where} built", False, "kernels.load returned None")
    else:
        b = 4096 if big else 64
        lengths = torch.randint(1, 513 if big else 65, (b,), generator=gen)
        cu = torch.zeros(b + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(lengths, 0)
        n = int(cu[-1])
        for dtype in (torch.float32, torch.float64):
            r = torch.randn(n, generator=gen, dtype=dtype).to(dev)
            v = torch.randn(n, generator=gen, dtype=dtype).to(dev)
            m = (torch.rand(n, generator=gen) < 0.8).to(dev)
            boot = torch.randn(b, generator=gen, dtype=dtype).to(dev)
            cud = cu.to(dev)
            ka, kr = mod.gae(r, v, cud, 0.99, 0.95, m, boot)
            ta, tr = gae_torch(r, v, cud, 0.99, 0.95, mask=m, bootstrap=boot)
            diff = float(torch.maximum((ka - ta).abs().max(), (kr - tr).abs().max()))
            scale = float(tr.abs().max())
            tol = (1e-4 if dtype == torch.float32 else 1e-10) * max(1.0, scale)
            reps = 10 if cuda else 3
            k_s = timed(lambda: mod.gae(r, v, cud, 0.99, 0.95, m, boot), reps)
            t_s = timed(lambda: gae_torch(r, v, cud, 0.99, 0.95, mask=m, bootstrap=boot), reps)
            key = f"gae_{where}_{str(dtype).removeprefix('torch.')}"
            it.figures[key] = {"tokens": n, "sequences": b, "max_abs_diff": diff, "tol": tol, "scale": scale,
                               "kernel_tokens_per_s": n / k_s, "twin_tokens_per_s": n / t_s,
                               "out_device": str(ka.device)}
            it.check(f"{key} equals gae_torch", diff <= tol, diff)
    mod = kernels.load("interval_copy", cuda=cuda)
    if mod is None:
        it.figures[f"interval_copy_{where}"] = {"built": False}
        it.check(f"interval_copy_{where} built", False, "kernels.load returned None")
        return
    size = (64 << 20) if big else (1 << 16)
    count = 100_000 if big else 500
    cuts = torch.sort(torch.randperm(size - 1, generator=gen)[: 2 * count] + 1).values
    starts, ends = cuts[0::2], cuts[1::2]
    lens = ends - starts
    total = int(lens.sum())
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.randn(size, generator=gen).to(dtype).to(dev)
        s, ln = starts.to(dev), lens.to(dev)
        out_k = torch.empty(total, dtype=dtype, device=dev)
        out_t = torch.empty(total, dtype=dtype, device=dev)
        mod.gather(flat, s, ln, out_k)
        gather_fallback(flat, s, ln, out_t)
        flat_k, flat_t = torch.zeros_like(flat), torch.zeros_like(flat)
        mod.scatter(flat_k, s, ln, out_k)
        scatter_fallback(flat_t, s, ln, out_t)
        reps = 10 if cuda else 3
        g_k = timed(lambda: mod.gather(flat, s, ln, out_k), reps)
        g_t = timed(lambda: gather_fallback(flat, s, ln, out_t), reps)
        moved = 2 * total * flat.element_size()  # read + write
        key = f"interval_copy_{where}_{str(dtype).removeprefix('torch.')}"
        it.figures[key] = {"intervals": count, "elements": total, "kernel_gather_gb_s": moved / g_k / 1e9,
                           "twin_gather_gb_s": moved / g_t / 1e9}
        it.check(f"{key} gather equals the fallback", bool(torch.equal(out_k, out_t)))
        it.check(f"{key} scatter equals the fallback", bool(torch.equal(flat_k, flat_t)))


def item_kernels(it: Item, ctx: Ctx) -> None:
    import importlib

    import realscale._kernels as pkg
    from realscale import kernels

    build = ctx.scratch / "kernels_build.json"
    if ctx.cuda:
        while not build.exists() and it.left() > 25:
            time.sleep(1.0)
        if not build.exists():
            raise RuntimeError("the kernel build did not finish within the item's budget")
        info = json.loads(build.read_text())
        it.figures["build"] = info
        if info.get("skipped"):
            it.skip(info["skipped"])
            return
        libdir = ctx.scratch / "kernels" / "lib" / "realscale" / "_kernels"
        if libdir.is_dir():
            pkg.__path__.append(str(libdir))  # the scratch build's extension modules
        importlib.invalidate_caches()
        kernels._import.cache_clear()
        it.figures["built"] = sorted(p.name.split(".")[0] for p in libdir.glob("*.so")) if libdir.is_dir() else []
        it.check("setup.py build_ext succeeded", info.get("rc") == 0, info.get("rc"))
        compare_kernels(it, ctx, cuda=True)
        try:  # the C++ CPU kernels of the same build, for the record (not a GPU matter)
            inner = Item("kernels-cpu", it.left())
            compare_kernels(inner, ctx, cuda=False)
            it.figures.update(inner.figures)
        except Exception as exc:  # noqa: BLE001 - a side figure
            it.figures["cpu_kernels_error"] = f"{type(exc).__name__}: {exc}"
        it.summary = ", ".join(f"{k}: {v.get('max_abs_diff', 'equal')}" for k, v in it.figures.items()
                               if k.startswith(("gae_cuda", "interval_copy_cuda")) and isinstance(v, dict))
        return
    # On CPU: the CUDA kernels cannot build; the comparison code runs on the C++ CPU kernels.
    it.skip("no CUDA device: csrc/cuda/*.cu build only with nvcc and a CUDA torch (setup.py); the same comparison "
            "ran on the C++ CPU kernels (figures *_cpu_*), where built")
    built = {name: kernels.load(name) is not None for name in ("gae", "interval_copy")}
    it.figures["cpu_kernels_built"] = built
    if any(built.values()):
        inner = Item("kernels-cpu", it.left())
        compare_kernels(inner, ctx, cuda=False)
        it.figures.update(inner.figures)
        it.checks.update(inner.checks)
    else:
        it.skip_part("CPU kernels vs twins", "the C++ kernels are not built here (pip install -e .)")
    it.summary = "CUDA kernels need nvcc and a GPU"


def _perturb(eng: Any, step: int) -> None:
    """Change every weight as training would: padded vocabulary rows stay zero (a tied
    output layer is the embedding itself); seeded by name and step."""
    import torch

    from realscale.models.convert import local_params

    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(local_params(eng.model).items())):
            g = torch.Generator().manual_seed(1000 * step + i)
            noise = 0.01 * torch.randn(p.shape, generator=g)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                noise[eng.arch.vocab_size:] = 0
            p.add_(noise.to(p.device, p.dtype))


def _export_devices(eng: Any, dtype: Any = None) -> dict[str, int]:
    counts: dict[str, int] = {}
    kwargs = {} if dtype is None else {"dtype": dtype}
    for bucket in eng.export_hf_weights(**kwargs):
        for _, t in bucket:
            counts[str(t.device)] = counts.get(str(t.device), 0) + 1
    return counts


def item_collectives(it: Item, ctx: Ctx) -> None:
    import torch
    import torch.distributed as dist

    import realscale.parallel.device as D
    from realscale.config import AlgoConfig, load_config
    from realscale.parallel.mesh import Layout, Mesh, Strategy
    from realscale.serve.colocated import ColocatedGeneration
    from realscale.serve.weights import full_megatron_tensors, shard_hashes
    from realscale.train.actor import mini_batches, split_for_dp, stage_needs
    from realscale.train.batch_scatter import BatchScatter
    from realscale.train.engine import EngineConfig, MegatronEngine

    contract_env = getattr(D, "CONTRACT_ENV", None) if hasattr(D, "check_comm") else None
    if contract_env is not None:
        os.environ.setdefault(contract_env, "nccl")  # on before the first collective (the parent sets it too)
    backend = ctx.dist()
    f = it.figures
    f.update(backend=backend, backend_auto=D.backend("auto"), local_device=str(D.local_device()),
             comm_device=str(D.comm_device(backend)), world_size=dist.get_world_size())
    want = "cuda" if ctx.cuda else "cpu"
    it.check("backend", backend == ("nccl" if ctx.cuda else "gloo"), backend)
    # 1. a collective on the communication device
    t = D.to_comm(torch.arange(8, dtype=torch.float32), backend)
    dist.all_reduce(t)
    f["to_comm_device"] = str(t.device)
    it.check("all_reduce on the comm device", t.device.type == want and bool(torch.equal(t.cpu(), torch.arange(8.0))),
             str(t.device))
    # 2. the weight export: each exported tensor's device
    path = _model("tiny-qwen2")
    eng = MegatronEngine(EngineConfig(model_path=path, lr=None, use_te=False))
    f["export_devices_default"] = _export_devices(eng)
    f["export_devices_dtype_given"] = _export_devices(eng, eng.config.params_dtype)
    off = {k: v for k, v in f["export_devices_default"].items() if not k.startswith(want)}
    it.check("export_hf_weights() stays on the device", not off,
             f"{sum(off.values())} tensors on {sorted(off)}: MegatronEngine.export_hf_weights casts with .cpu() "
             "when no dtype is given" if off else None)
    # 3. the batch scatter (world of one: the driver holds every share; its layout exchange runs on `backend`)
    batch = _rl_batch(eng.arch.vocab_size, 8, 5, 20)
    scatter = BatchScatter(eng.ranks, stage_needs(AlgoConfig()))
    mine, st = scatter.scatter(split_for_dp(batch, 2, 1))
    ref = mini_batches(batch, 2)
    same = len(mine) == len(ref) and all(
        torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
        and all(torch.equal(a.fields[k], b.fields[k]) for k in a.fields) for a, b in zip(mine, ref))
    f["batch_scatter"] = {"mini_batches": len(mine), "bytes": st.bytes, "seconds": st.seconds,
                          "fields": sorted(mine[0].fields) if mine else [], "devices": sorted({str(m.input_ids.device)
                                                                                               for m in mine})}
    it.check("batch scatter delivers the mini-batches", same)
    # 4. a colocated publish: the generation layout's weights equal the trainer's, twice
    cfg = load_config(None, ["parallel.mode=colocated", "rollout.max_staleness=0", "generate.num_servers=1",
                             "generate.tp=1", "generate.max_running_requests=4", "generate.context_length=64",
                             "parallel.release_idle_memory=true"])
    colo = ColocatedGeneration(cfg, path, eng)
    gen = Strategy.parse("d1t1p1")
    publishes = []
    try:
        for step in range(2):
            if step:
                _perturb(eng, step)
            stats = colo.publish(eng, step)
            got = colo.worker.weights.hashes()
            named = [nt for bucket in eng.export_hf_weights() for nt in bucket]
            expected = shard_hashes(colo.spec, Layout(Mesh(0, 1), gen), 0,
                                    full_megatron_tensors(named, colo.spec, eng.arch))
            differ = sorted(k for k in expected if got.get(k) != expected[k])
            publishes.append({"step": step, "tensors": len(expected), "differ": differ[:5],
                              "gen_weights_device": str(colo.worker.weights.flat.device),
                              "seconds": stats["perf/weight_sync_s"],
                              "local_bytes": stats["perf/weight_sync_local_bytes"]})
            it.check(f"publish {step}: generation weights equal the trainer's", not differ and len(expected) > 0,
                     differ[:5] or None)
            it.check(f"publish {step}: generation weights on the device",
                     colo.worker.weights.flat.device.type == want, str(colo.worker.weights.flat.device))
    finally:
        colo.close()
    f["publish"] = publishes
    # 5. the device contract (the GPU-path issue's): everything above ran under it when it is on
    f["device_contract_helpers"] = [n for n in dir(D) if "contract" in n.lower()]
    if contract_env is None:
        it.skip_part("device contract", "realscale/parallel/device.py has no device contract (check_comm, "
                                        "CONTRACT_ENV) yet")
    else:
        mode = D.device_contract()
        f["device_contract"] = {"env": f"{contract_env}={os.environ.get(contract_env, '')}", "mode": mode,
                                "installed": D.install_device_contract()}
        it.check("device contract on (every realscale collective above was checked)", mode == "nccl", mode)
        try:  # armed: a stray CPU tensor (no to_comm) is refused, as NCCL would refuse it
            D.check_comm(torch.zeros(2), backend, "gpu_check's stray CPU tensor")
            caught = None
        except D.DeviceContractError as exc:
            caught = str(exc)
        f["device_contract"]["refused"] = caught
        it.check("device contract refuses a CPU tensor that skipped to_comm", caught is not None)
    del eng
    ctx.free()
    if not ctx.cuda:
        it.skip("NCCL needs CUDA: the same checks ran at a world of one on gloo (figures and checks above)")
    it.summary = (f"{backend}: export {f['export_devices_default']}, scatter ok={same}, "
                  f"publish equal={all(not p['differ'] for p in publishes)}")


def item_server(it: Item, ctx: Ctx) -> None:
    import uuid

    import torch

    from realscale.serve.engine import Request, SamplingOptions
    from realscale.serve.server import EmbeddedServer, start_in_thread

    name = "tiny-qwen2" if ctx.quick else "small-qwen2"
    dtype = "bfloat16" if ctx.cuda else "float32"
    new_tokens = 8 if ctx.quick else 128
    server = EmbeddedServer(_model(name), device=ctx.device.type, dtype=dtype, max_running=64, context_length=1024)
    url, stop = start_in_thread(server)
    f = it.figures
    f.update(model=name, dtype=dtype, new_tokens=new_tokens, server_device=str(server.device))
    if ctx.cuda:
        f["kernel_build_running"] = not ctx.build_done()
    eng = server.engine
    gen = torch.Generator().manual_seed(0)

    def requests(n: int, max_new: int) -> list[Request]:
        out = []
        for _ in range(n):
            ids = torch.randint(10, eng.vocab_size - 10, (16,), generator=gen).tolist()
            out.append(Request(rid=uuid.uuid4().hex, input_ids=ids,
                               params=SamplingOptions(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)))
        return out

    try:
        it.check("server on the device", str(server.device).startswith(ctx.device.type), str(server.device))
        for r in requests(2, 4):  # warm-up
            eng.submit(r).result(timeout=120)
        for bs in (1, 16, 64):
            reqs = requests(bs, new_tokens)
            t0 = time.perf_counter()
            done = [eng.submit(r) for r in reqs]
            outs = [d.result(timeout=max(10.0, it.left())) for d in done]
            secs = time.perf_counter() - t0
            n_out = sum(len(r.output_ids) for r in outs)
            f[f"decode_batch{bs}"] = {"tokens": n_out, "seconds": secs, "tokens_per_s": n_out / secs,
                                      "ms_per_step": 1000 * secs / new_tokens}
            it.check(f"batch {bs}: every request decoded its tokens", n_out == bs * new_tokens, n_out)
        # pause latency while a batch decodes: retract three times (requests resume), then abort
        # long enough to outlast four pauses when this polling thread gets the CPU rarely (the
        # CPU dry run beside the end-to-end run: 48 tokens ran out after two pauses once, and
        # each later wait sat out its 60 s)
        long_new = 400 if ctx.quick else 1024
        reqs = requests(16, long_new)
        futs = [eng.submit(r) for r in reqs]
        lat: dict[str, list[float]] = {"retract": [], "abort": []}
        for mode in ("retract", "retract", "retract", "abort"):
            deadline = time.monotonic() + 60
            base = sum(len(r.output_ids) for r in reqs)
            while (sum(len(r.output_ids) for r in reqs) < base + 16 and time.monotonic() < deadline
                   and not all(fu.done() for fu in futs)):
                time.sleep(0.002)
            if all(fu.done() for fu in futs):
                it.check("the batch was still decoding at every pause", False, f"finished before the {mode} pause")
                break
            secs, _ = _post_json(f"{url}/pause_generation", {"mode": mode})
            lat[mode].append(secs)
            paused_running = len(eng.running)
            _post_json(f"{url}/continue_generation", {})
            if mode == "retract":
                it.check("a retract pause empties the running batch", paused_running == 0, paused_running)
        outs = [fu.result(timeout=120) for fu in futs]
        reasons = sorted({(o.finish_reason or {}).get("type", "none") for o in outs})
        f["pause_latency_ms"] = {m: [round(1000 * s, 2) for s in v] for m, v in lat.items()}
        if lat["retract"]:
            f["pause_latency_ms_median_retract"] = 1000 * statistics.median(lat["retract"])
        f["after_pause"] = {"finish_reasons": reasons, "retractions": sum(o.num_retractions for o in outs)}
        it.check("retracted requests came back", sum(o.num_retractions for o in outs) >= 16, f["after_pause"])
        it.check("the abort pause finished the batch", reasons == ["abort"] or "abort" in reasons, reasons)
    finally:
        stop()
    it.summary = (", ".join(f"bs{bs} {f[f'decode_batch{bs}']['tokens_per_s']:,.0f} tok/s" for bs in (1, 16, 64)
                            if f"decode_batch{bs}" in f)
                  + f", pause {f.get('pause_latency_ms_median_retract', float('nan')):.1f} ms")


WORKER_ITEMS: dict[str, Callable[[Item, Ctx], None]] = {
    "env": item_env, "engine": item_engine, "layer_stack": item_layer_stack, "kernels": item_kernels,
    "collectives": item_collectives, "server": item_server,
}


def _fault(name: str, it: Item) -> None:
    """Test hook (tests/scripts/test_gpu_check.py): ``GPU_CHECK_FAULT=item:hang,item:crash``
    makes that item hang or kill its worker after recording one check."""
    for spec in filter(None, os.environ.get("GPU_CHECK_FAULT", "").split(",")):
        item, _, kind = spec.partition(":")
        if item == name:
            it.figures["fault"] = kind
            it.check("before the injected fault", True)
            if kind == "hang":
                time.sleep(3600)
            if kind == "crash":
                os._exit(3)


def worker_main(args: argparse.Namespace) -> int:
    """Run ``args.worker`` items in order; each writes scratch/items/<name>.json."""
    names = [n for n in args.worker.split(",") if n]
    items_dir = Path(args.scratch) / "items"
    items_dir.mkdir(parents=True, exist_ok=True)
    budgets = json.loads(args.budgets)
    deadline = float(args.deadline)
    ctx = Ctx(args)
    for name in names:
        (items_dir / f"{name}.started").write_text(str(time.time()))
        left = deadline - time.time()
        budget = min(float(budgets[name]), left)
        it = Item(name, budget, partial=items_dir / f"{name}.partial.json")
        print(f"gpu_check: --- {name} (budget {budget:.0f} s)", flush=True)
        if left < 10:
            it.skip(f"the run's time budget was spent before this item ({left:.0f} s left)")
            rec = it.record()
        else:
            try:
                _fault(name, it)
                WORKER_ITEMS[name](it, ctx)
                rec = it.record()
            except BaseException as exc:  # noqa: BLE001 - one item's failure never loses the others
                tb = traceback.format_exc()
                print(tb, flush=True)
                rec = it.record(error=f"{type(exc).__name__}: {exc}"[:2000])
                rec["traceback"] = tb[-4000:]
            ctx.free()
        _write_json(items_dir / f"{name}.json", rec)
        print(f"gpu_check: --- {name}: {rec['status']} in {rec['seconds']:.1f} s {rec['reason'][:300]}", flush=True)
    return 0


# ====================================================================== the parent


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_plain(obj), indent=1))
    os.replace(tmp, path)


def _run_text(cmd: list[str], timeout: float = 30) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    """End a process this script started, and its process group (it was started in a session of its own)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", "replace")


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.total = args.budget or (QUICK_TOTAL_S if args.quick else TOTAL_S)
        self.deadline = self.wall0 + self.total
        self.budgets = dict(QUICK_BUDGETS if args.quick else BUDGETS)
        for spec in args.item_budget:
            name, _, secs = spec.partition("=")
            if name not in self.budgets or not secs:
                raise SystemExit(f"gpu_check: --item-budget {spec!r}: expected ITEM=SECONDS, ITEM one of "
                                 f"{', '.join(self.budgets)}")
            self.budgets[name] = float(secs)
        self.out = Path(args.out)
        self.scratch = Path(args.scratch)
        self.items_dir = self.scratch / "items"
        self.items_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.scratch / "gpu_check.log"
        self.results: dict[str, dict[str, Any]] = {}
        self.build: subprocess.Popen | None = None
        self.build_t0 = 0.0
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [self.env.get("PYTHONPATH")])])
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.setdefault("PYTHONWARNINGS", "ignore")
        if args.device == "cpu":
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        from realscale.parallel import device as D  # (stdlib only: cheap)

        # the device contract on in every process: a tensor that skips the device helpers on
        # its way into a realscale collective fails loudly (on CPU it simulates NCCL's rule)
        self.contract = getattr(D, "CONTRACT_ENV", None) if hasattr(D, "check_comm") else None
        if self.contract:
            self.env.setdefault(self.contract, "nccl")

    def note(self, text: str) -> None:
        line = f"gpu_check [{time.monotonic() - self.t0:6.1f} s] {text}"
        print(line, flush=True)
        with open(self.log, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    # ---------------------------------------------------------------- the kernel build

    def start_build(self) -> None:
        if self.args.device != "cuda" or "kernels" not in self.args.items:
            return
        nvcc = _nvcc()
        if nvcc is None:
            _write_json(self.scratch / "kernels_build.json",
                        {"skipped": "nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): the CUDA kernels cannot build"})
            return
        kdir = self.scratch / "kernels"
        kdir.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        env.setdefault("CUDA_HOME", str(Path(nvcc).resolve().parent.parent))
        cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(kdir / "lib"), "--build-temp",
               str(kdir / "tmp"), "-j", str(self.args.build_jobs)]
        self.note(f"kernel build: {' '.join(cmd)}")
        self.build_t0 = time.monotonic()
        self.build = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(kdir / "build.log", "w"),
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def poll_build(self, force_end: bool = False) -> None:
        if self.build is None:
            return
        rc = self.build.poll()
        secs = time.monotonic() - self.build_t0
        if rc is None and (force_end or secs > KERNEL_BUILD_S):
            _kill(self.build)
            rc = "killed"
        if rc is None:
            return
        log = self.scratch / "kernels" / "build.log"
        lib = self.scratch / "kernels" / "lib" / "realscale" / "_kernels"
        _write_json(self.scratch / "kernels_build.json",
                    {"rc": rc, "seconds": secs, "built": sorted(p.name for p in lib.glob("*.so")) if lib.is_dir() else [],
                     "failures": [ln[:500] for ln in _tail(log, 1 << 20).splitlines() if "failed to build" in ln],
                     "log_tail": _tail(log, 2000), "command": "setup.py build_ext (setup.py's extension list)"})
        self.note(f"kernel build ended: rc={rc} after {secs:.0f} s")
        with open(self.log, "a", encoding="utf-8") as fh:
            fh.write(_tail(log, 20000) + "\n")
        self.build = None

    # ---------------------------------------------------------------- worker stages

    def run_worker(self, names: list[str], reserve: float = 0.0) -> None:
        pending = [n for n in names if n in self.args.items]
        for n in names:
            if n not in self.args.items:
                self.results[n] = {"status": "skipped", "reason": "not among --items", "figures": {}, "checks": {}}
        while pending:
            stage_deadline = self.deadline - reserve
            env = dict(self.env)
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                       LOCAL_RANK="0")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(pending), "--out",
                   str(self.out), "--scratch", str(self.scratch), "--device", self.args.device,
                   "--budgets", json.dumps(self.budgets), "--deadline", str(stage_deadline),
                   "--stack-layers", str(self.args.stack_layers)] + (["--quick"] if self.args.quick else [])
            self.note(f"worker: {', '.join(pending)}")
            logf = open(self.log, "a", encoding="utf-8")
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            progress = time.monotonic()  # the worker's start, then each item's end
            started: dict[str, float] = {}
            limits: dict[str, float] = {}
            try:
                while pending:
                    self.poll_build()
                    name = pending[0]
                    res = self.items_dir / f"{name}.json"
                    if res.exists():
                        self.results[name] = json.loads(res.read_text())
                        self.note(f"{name}: {self.results[name]['status']}")
                        pending.pop(0)
                        progress = time.monotonic()
                        continue
                    now = time.monotonic()
                    if name not in started and (self.items_dir / f"{name}.started").exists():
                        started[name] = now  # the worker's own budget for it, as it computed it
                        limits[name] = min(float(self.budgets[name]), stage_deadline - time.time())
                    problem = None
                    if name in started and now - started[name] > limits[name] + min(15.0, 3 + 0.1 * limits[name]):
                        limit = limits[name]
                        problem = f"timed out: no result within its budget of {limit:.0f} s (the worker was killed)"
                    elif name not in started and now - progress > WORKER_START_S:
                        problem = f"the worker did not reach this item within {WORKER_START_S:.0f} s"
                    elif proc.poll() is not None:
                        time.sleep(0.5)
                        if res.exists():
                            continue
                        last = " | ".join(ln for ln in _tail(self.log, 600).splitlines()[1:] if ln.strip())
                        problem = f"the worker process died (exit code {proc.returncode}); its output ended: {last}"
                    if problem:
                        self.note(f"{name}: {problem[:200]}")
                        _kill(proc)
                        rec = {"figures": {}, "checks": {}}
                        partial = self.items_dir / f"{name}.partial.json"
                        if partial.exists():  # the figures and checks it had recorded by then
                            rec = json.loads(partial.read_text())
                        rec.update(status="failed", reason=problem, seconds=round(now - started.get(name, progress), 2))
                        self.results[name] = rec
                        pending.pop(0)
                        progress = time.monotonic()
                        break
                    time.sleep(0.2)
            finally:
                _kill(proc)
                logf.close()

    # ---------------------------------------------------------------- the end-to-end run

    def e2e_command(self, run_dir: Path) -> list[str]:
        common = [f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", "parallel.mode=colocated",
                  "rollout.max_staleness=0", "generate.num_servers=1", "generate.tp=1", "run.checkpoint_every=0",
                  "launch.backend=local", "rollout.filter_all_equal=false", "data.source=task:arith"]
        if self.args.quick:  # an untrained tiny model, two steps: the path runs; nothing is learnt
            return [sys.executable, "-m", "realscale", "train", *common, "model.path=tiny-qwen2",
                    "data.task_max_operand=2", "data.task_heldout=1", "run.total_steps=2", "rollout.batch_size=2",
                    "rollout.n_samples=2", "generate.max_new_tokens=4", "train.max_tokens_per_micro_batch=512",
                    "train.mini_batches=1", "algo.adv_estimator=reinforce", "optim.lr=1e-2", "run.seed=3"]
        # the tiny recipe (warm start, then GRPO), shortened: a shorter warm start, fewer steps
        return [sys.executable, "-m", "realscale", "train", str(ROOT / "configs" / "tiny_cpu.yaml"), *common,
                f"run.total_steps={self.args.e2e_steps}", f"sft.steps={self.args.e2e_sft_steps}",
                "data.task_heldout=64", "rollout.batch_size=16", "train.mini_batches=2", "optim.warmup_steps=1"]

    def start_e2e(self) -> tuple[subprocess.Popen, Path, float, Path]:
        run_dir = self.scratch / "e2e" / "run"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.e2e_command(run_dir)
        log = self.scratch / "e2e" / "train.log"
        self.note(f"e2e: {' '.join(cmd[1:])}")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.e2e_cmd = cmd
        return proc, run_dir, time.monotonic(), log

    def finish_e2e(self, proc: subprocess.Popen, run_dir: Path, start: float, log: Path) -> None:
        budget = min(self.budgets["e2e"], max(0.0, self.deadline - time.time() + (time.monotonic() - start)))
        it = Item("e2e", budget)
        it.start = start
        rc: Any = None
        while rc is None:
            rc = proc.poll()
            if rc is None and it.left() <= 0:
                _kill(proc)
                rc = "killed"
            self.poll_build()
            time.sleep(0.2)
        f = it.figures
        f.update(command="realscale " + " ".join(self.e2e_cmd[3:]), rc=rc, seconds=it.elapsed())
        try:
            if rc == "killed":
                raise RuntimeError(f"realscale train did not finish within its budget of {budget:.0f} s")
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            steps = [m for m in metrics if "train/loss" in m]
            keys = ("reward/mean", "reward/accuracy", "train/loss", "train/behav_kl", "train/grad_norm",
                    "rollout/response_len", "perf/step_s", "perf/weight_sync_s", "perf/trained_tokens_per_s")
            f["steps"] = [{"step": m["step"], **{k: m.get(k) for k in keys}} for m in steps]
            summary = json.loads((run_dir / "summary.json").read_text())
            f["accuracy_start"], f["accuracy_end"] = summary.get("accuracy_start"), summary.get("accuracy_end")
            total = int(self.e2e_cmd_value("run.total_steps"))
            it.check("realscale train exited 0", rc == 0, rc)
            it.check("every step logged", [m["step"] for m in steps] == list(range(1, total + 1)),
                     [m["step"] for m in steps])
            tol = 1e-4 if self.args.device == "cpu" else 1e-3
            kls = [abs(float(m.get("train/behav_kl", float("nan")))) for m in steps]
            f["behav_kl_tol"] = tol
            it.check("generation used the trainer's weights after every publish (|train/behav_kl| small)",
                     bool(kls) and all(k <= tol for k in kls), kls)
            rewards = [float(m.get("reward/mean", 0.0)) for m in steps]
            acc0 = (f["accuracy_start"] or {}).get("sampled")
            acc1 = (f["accuracy_end"] or {}).get("sampled")
            half = max(1, len(rewards) // 2)
            f["learns"] = {"reward_first_half": statistics.mean(rewards[:half]) if rewards else None,
                           "reward_second_half": statistics.mean(rewards[half:]) if rewards[half:] else None,
                           "heldout_sampled": [acc0, acc1]}
            if not self.args.quick:
                it.check("the policy was updated (a non-zero loss)", any(m.get("train/loss") for m in steps))
                up = (acc1 is not None and acc0 is not None and acc1 > acc0) or (
                    rewards[half:] and statistics.mean(rewards[half:]) > statistics.mean(rewards[:half]))
                f["learns"]["moved_up"] = bool(up)
                if not up:  # a few steps may not show it; recorded, not failed
                    it.skip_part("learning check", "neither the held-out accuracy nor the reward rose in this "
                                                   "short run (recorded in figures.learns, not failed)")
            else:
                it.skip_part("learning check", "--quick trains an untrained model for two steps: nothing to learn")
            it.summary = (f"{len(steps)} steps, reward {rewards[0] if rewards else 'n/a'} -> "
                          f"{rewards[-1] if rewards else 'n/a'}, held-out {acc0} -> {acc1}, max|behav_kl| "
                          f"{max(kls) if kls else 'n/a'}")
            rec = it.record()
        except Exception as exc:  # noqa: BLE001
            rec = it.record(error=f"{type(exc).__name__}: {exc}"[:1500])
            rec["log_tail"] = _tail(log, 3000)
        self.results["e2e"] = rec
        with open(self.log, "a", encoding="utf-8") as fh:
            fh.write("---- realscale train (tail)\n" + _tail(log, 20000) + "\n")
        self.note(f"e2e: {rec['status']} {rec['reason'][:200]}")

    def e2e_cmd_value(self, key: str) -> str:
        for a in self.e2e_cmd:
            if a.startswith(key + "="):
                return a.split("=", 1)[1]
        raise KeyError(key)

    def run_e2e(self, concurrent_with: Callable[[], None] | None = None) -> None:
        if "e2e" not in self.args.items:
            self.results["e2e"] = {"status": "skipped", "reason": "not among --items", "figures": {}, "checks": {}}
            if concurrent_with:
                concurrent_with()
            return
        if self.deadline - time.time() < 20:
            self.results["e2e"] = {"status": "skipped", "reason": "the run's time budget was spent before it",
                                   "figures": {}, "checks": {}}
            if concurrent_with:
                concurrent_with()
            return
        started = self.start_e2e()
        if concurrent_with:
            try:
                concurrent_with()
            except BaseException:
                _kill(started[0])
                raise
        self.finish_e2e(*started)

    # ---------------------------------------------------------------- all of it

    def run(self) -> int:
        self.note(f"device {self.args.device}, quick={self.args.quick}, budget {self.total:.0f} s, "
                  f"scratch {self.scratch}")
        self.start_build()
        first = ["env", "engine", "collectives", "server"]
        second = ["layer_stack", "kernels"]
        if self.args.quick:  # the end-to-end run beside the worker: timings are not the point here
            self.run_e2e(concurrent_with=lambda: self.run_worker(first + second))
        else:  # one thing on the GPU at a time, so that every timing is its own
            self.run_worker(first, reserve=E2E_RESERVE_S + SECOND_STAGE_RESERVE_S)
            self.run_e2e()
            self.run_worker(second)
        self.poll_build(force_end=True)
        return self.report()

    def report(self) -> int:
        not_run = []
        for name in ITEMS:
            rec = self.results.setdefault(name, {"status": "failed", "reason": "never ran", "figures": {},
                                                 "checks": {}})
            if rec["status"] != "ok":
                not_run.append({"what": name, "why": f"{rec['status']}: {rec.get('reason', '')}"[:600]})
            not_run.extend(rec.get("not_run", []))
        env = self.results.get("env", {}).get("figures", {})
        for mod in ("transformer_engine", "sglang", "vllm"):
            if not env.get(f"present/{mod}"):
                not_run.append({"what": mod, "why": "not installed on this machine (the local layer spec and the "
                                                    "embedded server stand in)"})
        not_run.append({"what": "multi-GPU NCCL (world size > 1)", "why": "one GPU: every collective ran at a world "
                                                                         "of one"})
        report = {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "device": self.args.device,
            "gpu": env.get("gpu"), "quick": self.args.quick, "budget_s": self.total,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.wall0)),
            "wall_s": round(time.monotonic() - self.t0, 1),
            "device_contract": f"{self.contract}={self.env[self.contract]}" if self.contract else "absent",
            "items": {n: self.results[n] for n in ITEMS},
            "not_run": not_run,
        }
        problems = validate_report(report, self.args.device)
        report["form_problems"] = problems
        self.out.mkdir(parents=True, exist_ok=True)
        _write_json(self.out / "gpu_check.json", report)
        table = self.table(report)
        (self.out / "gpu_check.txt").write_text(table)
        data = self.log.read_bytes() if self.log.exists() else b""
        (self.out / "gpu_check.log").write_bytes(data[-LOG_TAIL_BYTES:])
        print(table, flush=True)
        return 1 if any(r["status"] == "failed" for r in report["items"].values()) or problems else 0

    @staticmethod
    def table(report: dict[str, Any]) -> str:
        rows = [f"gpu_check: device {report['device']}{' (' + report['gpu'] + ')' if report.get('gpu') else ''}, "
                f"quick={report['quick']}, {report['wall_s']:.0f} s of {report['budget_s']:.0f}",
                f"{'item':<12} {'status':<8} {'s':>6}  figures / reason"]
        for name, rec in report["items"].items():
            text = rec.get("summary") or ""
            if rec["status"] != "ok":
                text = (text + " | " if text else "") + rec.get("reason", "")
            text = " ".join(text.split())
            rows.append(f"{name:<12} {rec['status']:<8} {rec.get('seconds', 0):>6.1f}  {text[:300]}")
        rows.append("not run:")
        rows += [f"  - {x['what']}: {' '.join(x['why'].split())[:200]}" for x in report["not_run"]]
        if report.get("form_problems"):
            rows.append("report problems: " + "; ".join(report["form_problems"]))
        return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json, gpu_check.txt, gpu_check.log")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when a GPU is visible")
    p.add_argument("--quick", action="store_true", help="small everything (the CPU dry run)")
    p.add_argument("--scratch", default=None, help="large files (default: a temporary folder, removed at the end)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 470; quick 330)")
    p.add_argument("--items", default=",".join(ITEMS), help="comma-separated subset of " + ",".join(ITEMS))
    p.add_argument("--stack-layers", type=int, default=4, help="layers of the 1.5B-class stack (Qwen2-1.5B has 28)")
    p.add_argument("--e2e-steps", type=int, default=8, help="RL steps of the end-to-end run (not --quick)")
    p.add_argument("--e2e-sft-steps", type=int, default=300, help="warm-start steps of the end-to-end run (the "
                   "tiny recipe's own)")
    p.add_argument("--build-jobs", type=int, default=7, help="parallel compiles of the kernel build (one per "
                   "extension: 5 C++ and 2 CUDA)")
    p.add_argument("--item-budget", action="append", default=[], metavar="ITEM=SECONDS",
                   help="another time budget for an item (repeatable), e.g. e2e=300")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budgets", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--deadline", default="0", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.items = [s.strip() for s in args.items.split(",") if s.strip()]
    unknown = sorted(set(args.items) - set(ITEMS))
    if unknown:
        p.error(f"--items: unknown {unknown}; choose from {','.join(ITEMS)}")
    keep = args.scratch is not None
    args.scratch = args.scratch or tempfile.mkdtemp(prefix="gpu_check.")
    try:
        return Runner(args).run()
    finally:
        if not keep:
            shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

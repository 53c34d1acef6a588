"""Start real SGLang servers (``generate.backend = sglang``): SGLang on GPUs, SGLang-on-CPU here.

Written against the pinned SGLang's ``python -m sglang.launch_server`` options
(``sglang_reference.PINNED``; a contract test checks every option against its source).
The argv and environment are built by pure functions (:func:`sglang_command`,
:func:`sglang_env`) so every rule is checked without starting anything; the local
launcher (:mod:`realscale.launcher.local`) and the Slurm server step
(:mod:`realscale.launcher.roles`) both start servers this way. Before any server starts,
:func:`check_sglang_version` refuses an installed SGLang outside ``SUPPORTED``.

On a CPU machine the same server runs unmodified (``SGLANG_USE_CPU_ENGINE=1``; installed
by ``scripts/sglang_cpu/install.sh`` into a venv of its own, run from there): the CI's
``sglang`` tier starts it this way. What differs on CPU, and why:

- :data:`CPU_FLAGS`: ``--device cpu``, the torch-native attention and the PyTorch sampler
  (the default backends are CUDA kernels), no CUDA graphs, no grammar backend (xgrammar's
  CPU build is not installed), ``--sleep-on-idle`` (an idle scheduler otherwise spins a
  core, which a two-core machine shares with the trainer).
- memory: SGLang-on-CPU sizes its KV pool from the host's memory times
  ``--mem-fraction-static`` (0.8 of the GPU recipes would reserve most of the machine);
  on CPU the pool is ``--max-total-tokens`` = every running request at full context
  (:func:`cpu_kv_tokens`) within :data:`CPU_MEM_FRACTION` of the memory.
- threads: ``generate.cpu_threads`` OpenMP threads per rank; with ``--tp-size`` above 1
  SGLang asserts one NUMA node per rank unless ``SGLANG_CPU_OMP_THREADS_BIND`` gives each
  rank its cores (``sglang/srt/utils/numa_utils.py``, ``init_threads_binding``), so
  :func:`cpu_bind` splits this process's CPUs between the ranks.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import TYPE_CHECKING

from realscale.errors import LaunchError
from realscale.inference.sglang_reference import PINNED, SUPPORTED

if TYPE_CHECKING:
    from realscale.config import GenerateConfig

CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--grammar-backend", "none", "--sleep-on-idle")
CPU_MEM_FRACTION = 0.05
CPU_INSTALL = "on a CPU machine `bash scripts/sglang_cpu/install.sh` and run from its venv (README, 'SGLang backend')"


class SGLangVersionError(LaunchError):
    """The installed SGLang is missing or outside the supported range."""


def check_sglang_version(installed: str | None = None) -> str:
    """The installed SGLang's version (or ``installed``) if it is in ``SUPPORTED``;
    otherwise :class:`SGLangVersionError` with a one-line message."""

    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    fix = (f"pip install 'sglang{SUPPORTED}' with your CUDA torch, or {CPU_INSTALL} "
           f"(realscale speaks SGLang {PINNED}'s protocol)")
    if installed is None:
        try:
            installed = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            raise SGLangVersionError(f"generate.backend=sglang but SGLang is not installed: {fix}") from None
    try:
        ok = SpecifierSet(SUPPORTED).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise SGLangVersionError(f"SGLang {installed} is installed; realscale supports sglang{SUPPORTED}: {fix}")
    return installed


def sglang_command(model_path: str, port: int, gen: GenerateConfig, *, host: str | None = None, seed: int = 0,
                   dtype: str = "auto", on_gpu: bool = True, weight_version: str = "0",
                   extra: list[str] | None = None, routed_experts: bool = False) -> list[str]:
    """The ``sglang.launch_server`` argv of one server for the ``generate`` section ``gen``
    (``dtype``: the trainer's ``model.dtype``, so the served log-probs are the trainer's).

    ``pause_mode`` other than abort turns SGLang's prefix (radix) cache off. A weight
    update under a retract / in_place pause finds requests still on the server, so
    SGLang refuses the cache flush (``flush_cache`` answers 400 while requests run:
    ``scheduler_components/weight_updater.py:120``, ``scheduler.py:5518`` in 0.5.23) and
    keeps the prefix KV of the old weights: measured on SGLang-on-CPU
    (scripts/sglang_cpu/smoke.py), a later request sharing that prefix reused 7 stale
    tokens and sampled other tokens (log-probs off by up to 0.91). Without a prefix
    cache there is nothing stale to reuse; after an abort pause nothing runs and the
    flush succeeds."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host or gen.host,
           "--port", str(port), "--tp-size", str(gen.tp), "--dtype", dtype, "--random-seed", str(seed),
           "--weight-version", str(weight_version), "--skip-server-warmup",
           "--context-length", str(gen.context_length), "--max-running-requests", str(gen.max_running_requests)]
    if on_gpu:
        cmd += ["--mem-fraction-static", str(gen.mem_fraction_static)]
    else:
        cmd += [*CPU_FLAGS, "--mem-fraction-static", str(CPU_MEM_FRACTION), "--max-total-tokens", str(cpu_kv_tokens(gen))]
    if gen.pause_mode != "abort":
        cmd += ["--disable-radix-cache"]
    if gen.ep > 1:  # experts over ep of the server's tp ranks (srt/arg_groups/fields/parallel.py: ep_size)
        cmd += ["--ep-size", str(gen.ep)]
    if routed_experts:  # routing replay (srt/arg_groups/fields/exec_.py: enable_return_routed_experts)
        cmd += ["--enable-return-routed-experts"]
    return cmd + list(extra or [])


def cpu_kv_tokens(gen: GenerateConfig) -> int:
    """SGLang-on-CPU's KV pool in tokens: every running request at full context."""
    return gen.max_running_requests * gen.context_length


def sglang_env(gen: GenerateConfig, *, on_gpu: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one SGLang server (module docstring): on CPU the CPU engine,
    ``generate.cpu_threads`` threads per rank and, with several ranks, their cores."""
    env = dict(os.environ if base is None else base)
    # SGLang's uvicorn closes an idle keep-alive connection after 5 s (SGLANG_TIMEOUT_KEEP_ALIVE,
    # sglang/srt/environ.py:337, read by http_server.py:2956): the client's pooled control
    # connections sit idle for a whole training step, and one closed just as a request goes
    # out reads as a dead server (vLLM's is raised the same way, vllm_server.vllm_env)
    env.setdefault("SGLANG_TIMEOUT_KEEP_ALIVE", "3600")
    if on_gpu:
        return env
    threads = gen.cpu_threads
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if gen.tp > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind(gen.tp, threads, sorted(os.sched_getaffinity(0)))
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def cpu_bind(ranks: int, threads: int, cpus: list[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks of ``threads`` threads each on
    ``cpus`` (the CPUs this process may use), in turn, wrapping round when there are fewer;
    each rank's CPUs as ranges, SGLang's form: ``cpu_bind(2, 1, [0, 1]) == "0|1"``,
    ``cpu_bind(2, 4, list(range(8))) == "0-3|4-7"``."""
    groups = [sorted({cpus[(r * threads + k) % len(cpus)] for k in range(threads)}) for r in range(ranks)]
    return "|".join(",".join(_ranges(g)) for g in groups)


def _ranges(ids: list[int]) -> list[str]:
    """Sorted CPU ids as ranges: [0, 1, 2, 5] -> ["0-2", "5"]."""
    out: list[list[int]] = []
    for i in ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return [f"{a}-{b}" if b > a else str(a) for a, b in out]

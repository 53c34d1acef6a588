"""Start real SGLang servers on GPUs (``generate.backend = sglang``).

GPU-only: written against the pinned SGLang's ``python -m sglang.launch_server`` options
(``sglang_reference.PINNED``; a contract test checks every option against its source) but
NOT run on the CPU machine this project is developed on (no CUDA, SGLang not installed);
its tests carry the ``gpu`` marker. The command line is built by a pure function
(:func:`sglang_command`) so that part is checked everywhere. Before any server starts,
:func:`check_sglang_version` refuses an installed SGLang outside ``SUPPORTED``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import metadata
from typing import TYPE_CHECKING

from realscale.errors import LaunchError
from realscale.inference.sglang_reference import PINNED, SUPPORTED

if TYPE_CHECKING:
    from realscale.config import GenerateConfig


class SGLangVersionError(LaunchError):
    """The installed SGLang is missing or outside the supported range."""


def check_sglang_version(installed: str | None = None) -> str:
    """The installed SGLang's version (or ``installed``) if it is in ``SUPPORTED``;
    otherwise :class:`SGLangVersionError` with a one-line message."""

    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    fix = f"pip install 'sglang{SUPPORTED}' (realscale speaks SGLang {PINNED}'s protocol)"
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


def sglang_command(model_path: str, port: int, host: str = "127.0.0.1", *, tp: int = 1,
                   context_length: int = 0, max_running_requests: int = 0, mem_fraction_static: float = 0.0,
                   dtype: str = "auto", seed: int = 0, weight_version: str = "0", pause_mode: str = "abort",
                   extra: list[str] | None = None) -> list[str]:
    """The ``sglang.launch_server`` argv for one server.

    ``pause_mode`` other than abort turns SGLang's prefix (radix) cache off. A weight
    update under a retract / in_place pause finds requests still on the server, so
    SGLang refuses the cache flush (``flush_cache`` answers 400 while requests run:
    ``scheduler_components/weight_updater.py:120``, ``scheduler.py:5518`` in 0.5.23) and
    keeps the prefix KV of the old weights: measured on SGLang-on-CPU
    (scripts/sglang_cpu/smoke.py), a later request sharing that prefix reused 7 stale
    tokens and sampled other tokens (log-probs off by up to 0.91). Without a prefix
    cache there is nothing stale to reuse; after an abort pause nothing runs and the
    flush succeeds."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--tp-size", str(tp), "--dtype", dtype, "--random-seed", str(seed),
           "--weight-version", str(weight_version), "--skip-server-warmup"]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    if max_running_requests:
        cmd += ["--max-running-requests", str(max_running_requests)]
    if mem_fraction_static:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if pause_mode != "abort":
        cmd += ["--disable-radix-cache"]
    return cmd + list(extra or [])


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 600.0) -> None:
    """Poll ``url/health`` until 200; raise if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"SGLang server for {url} exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"SGLang server {url} not healthy within {timeout:.0f} s")


def launch_sglang(cfg: GenerateConfig, model_path: str, gpu_ids: list[list[int]], log_dir: str) -> list[tuple[str, subprocess.Popen]]:
    """Start ``len(gpu_ids)`` servers (server i on GPUs ``gpu_ids[i]``); return (url, process) pairs.

    ``cfg`` is the ``generate`` config section. Each server's stdout/stderr go to
    ``log_dir/sglang_<i>.log``.
    """
    check_sglang_version()
    os.makedirs(log_dir, exist_ok=True)
    servers = []
    for i, gpus in enumerate(gpu_ids):
        port = cfg.base_port + i
        cmd = sglang_command(model_path, port, cfg.host, tp=len(gpus), context_length=cfg.context_length,
                             max_running_requests=cfg.max_running_requests,
                             mem_fraction_static=cfg.mem_fraction_static, pause_mode=cfg.pause_mode)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        log = open(os.path.join(log_dir, f"sglang_{i}.log"), "ab")  # noqa: SIM115 - lives with the process
        servers.append((f"http://{cfg.host}:{port}", subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
    for url, proc in servers:
        wait_healthy(url, proc)
    return servers

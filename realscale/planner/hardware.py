"""GPU profiles for the cost model, the efficiency constants it assumes, and where every
number comes from.

Peak numbers are vendor datasheet figures (dense bf16, no sparsity). Link bandwidths
are per GPU and per direction: NVLink for GPUs of one node, InfiniBand (one NIC per GPU,
as on DGX/HGX nodes) across nodes. A user adds or overrides profiles in YAML::

    my-gpu: {peak_tflops: 500, hbm_gb: 96, hbm_tbps: 4.0, nvlink_gbps: 450, ib_gbps: 50}

Every constant carries a :class:`Source`: ``published`` (a datasheet or paper, named),
``measured`` (on this machine, by :mod:`realscale.launcher.calibrate`), ``fitted``
(least-squares fit to named figures) or ``assumed`` (a typical value, with why).
:class:`HardwareProfile` bundles a :class:`GPU`, an :class:`Efficiency` and those sources,
and is what ``realscale profile`` writes and ``realscale plan --profile`` /
``realscale simulate --profile`` read (JSON).

**Honesty:** the :class:`Efficiency` defaults are *assumptions* (typical published
Megatron / SGLang figures), not measurements on a cluster. The CPU profile is measured
and fitted on this machine (``realscale profile``); the H800 efficiencies calibrated on
the AReaL paper's 1.5B figures live in ``benchmarks/results/sim_calibration.json``
(:mod:`realscale.sim.paper`). No GPU profile here was measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from realscale.errors import UserError


class HardwareError(UserError):
    """An unknown GPU name or a malformed profile."""


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float   # dense bf16 tensor-core peak
    hbm_gb: float        # usable device memory (GB = 1e9 bytes)
    hbm_tbps: float      # HBM bandwidth, TB/s
    nvlink_gbps: float   # per GPU per direction, GB/s
    ib_gbps: float       # per GPU per direction across nodes, GB/s
    pcie_gbps: float = 25.0  # host <-> device, for offloading optimizer states
    # CPUs shared by every role on one host (a CPU machine: servers, trainer, controller and
    # reward workers compete for them); 0: each role has its own devices (GPUs), not modelled
    host_cores: float = 0.0


PROFILES: dict[str, GPU] = {
    "A100": GPU("A100", 312.0, 80.0, 2.04, 300.0, 25.0),
    "H800": GPU("H800", 989.0, 80.0, 3.35, 200.0, 50.0),
    "H100": GPU("H100", 989.0, 80.0, 3.35, 450.0, 50.0),
    "H200": GPU("H200", 989.0, 141.0, 4.8, 450.0, 50.0),
    # One CPU core as a "GPU": plans for a CPU machine (a 1-node "cluster" of N cores,
    # `realscale plan --nodes 1 --gpus-per-node N --gpu cpu`). Rough assumptions for a
    # recent x86 core (fp32 AVX2, a share of DRAM bandwidth, shared-memory gloo), not
    # measurements; on one machine only the ranking of layouts matters.
    "cpu": GPU("cpu", 0.1, 8.0, 0.01, 5.0, 1.0, 5.0),
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak reached in practice. All are assumptions unless calibrated."""

    mfu_train: float = 0.45       # Megatron dense training matmul efficiency
    mfu_prefill: float = 0.55     # prefill / forward-only passes
    mfu_decode: float = 0.30      # compute-bound decode (large batches)
    hbm_decode: float = 0.65      # fraction of HBM bandwidth a decode step reaches
    link: float = 0.75            # fraction of link bandwidth collectives reach
    tp_overhead: float = 0.04     # per extra tp rank: smaller GEMMs lose efficiency
    decode_step_overhead_s: float = 1.5e-3  # scheduling + launches per decode step
    collective_latency_s: float = 12e-6     # per all-reduce (NVLink, small messages)
    weight_update_overhead_s: float = 1.0   # pause / resume servers around an update
    recompute_cost: float = 1.33  # training time multiplier with activation recompute
    decode_seq_overhead_s: float = 0.0      # per running request per decode step (sampling, bookkeeping)
    train_step_overhead_s: float = 0.0      # per optimizer step (optimizer update, schedule set-up)
    request_overhead_s: float = 0.0         # server time per request admitted (HTTP, scheduling)
    client_request_cpu_s: float = 0.0       # host CPU per request outside the server (controller, reward)
    decode_ctx_overhead_s: float = 0.0      # per running request and context token per decode step


@dataclass(frozen=True)
class Source:
    """Where a constant comes from: ``kind`` is published, measured, fitted or assumed."""

    kind: str
    ref: str

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise HardwareError(f"source kind {self.kind!r} is not one of {', '.join(SOURCE_KINDS)}")


SOURCE_KINDS = ("published", "measured", "fitted", "assumed")
_NV = "NVIDIA datasheet"
_DENSE = "dense BF16 tensor-core peak (half the with-sparsity figure)"
GPU_SOURCES: dict[str, dict[str, Source]] = {
    "A100": {"peak_tflops": Source("published", f"{_NV} A100 SXM4: {_DENSE}, 312 TFLOPS"),
             "hbm_gb": Source("published", f"{_NV} A100 80GB SXM4: 80 GB HBM2e"),
             "hbm_tbps": Source("published", f"{_NV} A100 80GB SXM4: 2,039 GB/s"),
             "nvlink_gbps": Source("published", f"{_NV} A100: NVLink 3, 600 GB/s both directions"),
             "ib_gbps": Source("published", "DGX A100 datasheet: 8 x ConnectX-6 HDR 200 Gb/s, one per GPU"),
             "pcie_gbps": Source("assumed", "PCIe Gen4 x16 (32 GB/s) at ~80% in practice")},
    "H100": {"peak_tflops": Source("published", f"{_NV} H100 SXM5: {_DENSE}, 989 TFLOPS"),
             "hbm_gb": Source("published", f"{_NV} H100 SXM5: 80 GB HBM3"),
             "hbm_tbps": Source("published", f"{_NV} H100 SXM5: 3.35 TB/s"),
             "nvlink_gbps": Source("published", f"{_NV} H100 SXM5: NVLink 4, 900 GB/s both directions"),
             "ib_gbps": Source("published", "DGX H100 datasheet: 8 x ConnectX-7 NDR 400 Gb/s, one per GPU"),
             "pcie_gbps": Source("assumed", "PCIe Gen5 x16 (64 GB/s) limited by host pinned-memory copies")},
    "H800": {"peak_tflops": Source("published", f"{_NV} H800 SXM5 (China export H100): same compute, 989 TFLOPS"),
             "hbm_gb": Source("published", f"{_NV} H800 SXM5: 80 GB HBM3"),
             "hbm_tbps": Source("published", f"{_NV} H800 SXM5: 3.35 TB/s"),
             "nvlink_gbps": Source("published", f"{_NV} H800 SXM5: NVLink 400 GB/s both directions"),
             "ib_gbps": Source("assumed", "400 Gb/s per GPU as on DGX H100; the AReaL paper's fabric is not modelled"),
             "pcie_gbps": Source("assumed", "as H100")},
    "H200": {"peak_tflops": Source("published", f"{_NV} H200 SXM: {_DENSE}, 989 TFLOPS"),
             "hbm_gb": Source("published", f"{_NV} H200 SXM: 141 GB HBM3e"),
             "hbm_tbps": Source("published", f"{_NV} H200 SXM: 4.8 TB/s"),
             "nvlink_gbps": Source("published", f"{_NV} H200 SXM: NVLink 4, 900 GB/s both directions"),
             "ib_gbps": Source("published", "DGX H200 datasheet: 8 x ConnectX-7 400 Gb/s, one per GPU"),
             "pcie_gbps": Source("assumed", "as H100")},
    # main's "cpu" entry: placement on a CPU machine, where only the ranking of layouts
    # matters. A measured CPU profile comes from `realscale profile` instead.
    "cpu": {k: Source("assumed", f"one recent x86 core as a planner 'GPU' ({why}); not measured: "
                                 "`realscale profile` measures this machine")
            for k, why in (("peak_tflops", "fp32 AVX2"), ("hbm_gb", "a share of host RAM"),
                           ("hbm_tbps", "a share of DRAM bandwidth"), ("nvlink_gbps", "shared-memory gloo"),
                           ("ib_gbps", "gloo over TCP"), ("pcie_gbps", "no device copy"))},
}
EFFICIENCY_SOURCES: dict[str, Source] = {
    "mfu_train": Source("assumed", "Megatron-LM dense GPT training reaches 40-55% MFU on H100 (NVIDIA Megatron-LM "
                                   "README scaling table); 0.45 taken"),
    "mfu_prefill": Source("assumed", "forward-only large-batch GEMMs, a little above training"),
    "mfu_decode": Source("assumed", "compute-bound decode at large batch (SGLang/vLLM benchmarks: 25-35%)"),
    "hbm_decode": Source("assumed", "memory-bound decode reaches 60-70% of HBM bandwidth (vLLM/SGLang kernels)"),
    "link": Source("assumed", "NCCL ring all-reduce bus bandwidth ~75% of link peak (nccl-tests)"),
    "tp_overhead": Source("assumed", "smaller GEMMs per extra tp rank"),
    "decode_step_overhead_s": Source("assumed", "scheduler + kernel launches per decode step with CUDA graphs"),
    "collective_latency_s": Source("assumed", "small-message NVLink all-reduce latency"),
    "weight_update_overhead_s": Source("assumed", "pause / resume of servers around a weight update"),
    "recompute_cost": Source("assumed", "full recomputation adds one forward: (1 + 2 + 1) / (1 + 2) of fwd+bwd"),
    "decode_seq_overhead_s": Source("assumed", "0 on GPUs: SGLang samples the whole batch in one kernel"),
    "train_step_overhead_s": Source("assumed", "0 on GPUs: the optimizer step is folded into mfu_train"),
    "request_overhead_s": Source("assumed", "0 on GPUs: SGLang's tokenizer and HTTP run outside the scheduler"),
    "decode_ctx_overhead_s": Source("assumed", "0 on GPUs: attention reads the KV cache at HBM speed (the memory "
                                               "term)"),
    "client_request_cpu_s": Source("assumed", "0 on GPUs: the controller's host CPUs are not a shared bottleneck "
                                              "(gpu.host_cores 0)"),
}
_HOST = Source("assumed", "0: every role on its own GPUs; host CPUs are not modelled as shared")


def load_profiles(path: str) -> dict[str, GPU]:
    """Built-in profiles updated with those in the YAML file ``path``."""
    import yaml

    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise HardwareError(f"{path}: expected a mapping of GPU name -> profile")
    out = dict(PROFILES)
    names = {f.name for f in dataclasses.fields(GPU)} - {"name"}
    for gpu, fields in data.items():
        if not isinstance(fields, dict):
            raise HardwareError(f"{path}: profile {gpu!r} must be a mapping")
        unknown = set(fields) - names
        if unknown:
            raise HardwareError(f"{path}: profile {gpu!r} has unknown keys {sorted(unknown)} (known: {sorted(names)})")
        base = dataclasses.asdict(out[gpu]) if gpu in out else {}
        base.update({k: float(v) for k, v in fields.items()})
        base["name"] = str(gpu)
        missing = names - set(base) - {"pcie_gbps", "host_cores"}  # these have defaults
        if missing:
            raise HardwareError(f"{path}: new profile {gpu!r} lacks {sorted(missing)}")
        out[str(gpu)] = GPU(**base)
    return out


def get_gpu(name: str, profiles: dict[str, GPU] | None = None) -> GPU:
    table = profiles or PROFILES
    for key, gpu in table.items():
        if key.lower() == name.lower():
            return gpu
    raise HardwareError(f"unknown GPU {name!r}; known: {', '.join(table)} (add one with --gpu-profiles FILE.yaml)")


@dataclass
class HardwareProfile:
    """A device for the cost model and the simulator: its :class:`GPU` numbers, its
    :class:`Efficiency`, the :class:`Source` of every field (``gpu.<field>`` /
    ``eff.<field>``), and, for measured profiles, the raw measurements they were fitted to."""

    name: str
    gpu: GPU
    eff: Efficiency = dataclasses.field(default_factory=Efficiency)
    sources: dict[str, Source] = dataclasses.field(default_factory=dict)
    measurements: dict = dataclasses.field(default_factory=dict)

    def source(self, key: str) -> Source:
        return self.sources.get(key, Source("assumed", "no source recorded"))

    def to_dict(self) -> dict:
        return {"name": self.name, "gpu": dataclasses.asdict(self.gpu), "eff": dataclasses.asdict(self.eff),
                "sources": {k: [v.kind, v.ref] for k, v in sorted(self.sources.items())},
                "measurements": self.measurements}

    @classmethod
    def from_dict(cls, data: dict, origin: str = "profile") -> "HardwareProfile":
        try:
            gpu = GPU(**data["gpu"])
            eff = Efficiency(**data.get("eff", {}))
            sources = {k: Source(*v) for k, v in data.get("sources", {}).items()}
        except (KeyError, TypeError) as exc:
            raise HardwareError(f"{origin}: not a hardware profile ({exc})") from None
        return cls(str(data.get("name", gpu.name)), gpu, eff, sources, dict(data.get("measurements", {})))

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1)
            fh.write("\n")

    def table(self) -> str:
        """Every constant, its value and its source, one per line."""
        rows = [(f"gpu.{k}", v) for k, v in dataclasses.asdict(self.gpu).items() if k != "name"]
        rows += [(f"eff.{k}", v) for k, v in dataclasses.asdict(self.eff).items()]
        return "\n".join(f"{k:<30} {v:<12.6g} {self.source(k).kind:<9} {self.source(k).ref}" for k, v in rows)


def builtin_profile(name: str) -> HardwareProfile:
    """A built-in GPU with the assumed efficiencies, every constant labelled."""
    gpu = get_gpu(name)
    sources = {f"gpu.{k}": v for k, v in GPU_SOURCES.get(gpu.name, {}).items()}
    sources.setdefault("gpu.host_cores", _HOST)
    sources.update({f"eff.{k}": v for k, v in EFFICIENCY_SOURCES.items()})
    return HardwareProfile(gpu.name, gpu, Efficiency(), sources)


def load_profile(path_or_name: str) -> HardwareProfile:
    """A profile JSON written by ``realscale profile`` (or a calibration), else a built-in GPU name."""

    if os.path.isfile(path_or_name):
        try:
            with open(path_or_name, encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise HardwareError(f"{path_or_name}: not JSON ({exc})") from None
        return HardwareProfile.from_dict(data, path_or_name)
    if path_or_name.endswith(".json"):
        raise HardwareError(f"profile file not found: {path_or_name} (measure one with `realscale profile`)")
    return builtin_profile(path_or_name)

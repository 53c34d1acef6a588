"""GPU profiles for the cost model, and the efficiency constants it assumes.

Peak numbers are vendor datasheet figures (dense bf16, no sparsity). Link bandwidths
are per GPU and per direction: NVLink for GPUs of one node, InfiniBand (one NIC per GPU,
as on DGX/HGX nodes) across nodes. A user adds or overrides profiles in YAML::

    my-gpu: {peak_tflops: 500, hbm_gb: 96, hbm_tbps: 4.0, nvlink_gbps: 450, ib_gbps: 50}

**Honesty:** :class:`Efficiency` holds the fractions of peak that real kernels reach;
they are *assumptions* (typical published Megatron / SGLang figures), not measurements
on a cluster. :func:`realscale.planner.calibrate.measure` measures matmul efficiency and
memory bandwidth on the local device and can replace the first two on a GPU machine.
Until a GPU cluster run calibrates them, the cost model's absolute times are estimates;
its *ranking* of layouts is what the planner relies on.
"""

from __future__ import annotations

import dataclasses
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
        missing = names - set(base) - {"pcie_gbps"}  # pcie has a default
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

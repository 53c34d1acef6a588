"""Does delta weight sync pay? Consecutive policy versions of a real run, measured (issue 31, item 4).

A weight update today sends every parameter byte to the servers (full sync). A delta sync
would send only what changed since the version the servers hold. This benchmark takes the
consecutive policy versions a run published (version 0 = the warm start, version k = the
weights after RL step k: what the servers received after each step) and, for each pair
(k-1, k), measures:

- the fraction of elements whose bits changed, in the run's parameter dtype (fp32 on CPU)
  and as the weights travel to bf16 servers (both versions cast to bf16, round to nearest
  even as the export's cast does, then compared bit for bit);
- the bytes of each delta encoding, against the full bytes in that dtype:

  ``full``       every byte (the baseline), and the same compressed;
  ``tensor``     per tensor: only the tensors with any changed element (+4 B id each);
  ``sparse``     per element: int32 index into the flat model + the new value (verl's
                 ``delta_sharded`` (position, value) pairs); compressed: index gaps + values;
  ``block4k``    per 4 KiB block of the flat model: changed blocks (+4 B block index each);
  ``xor``        new XOR old over the whole flat model (dense, no index), compressed only
                 (raw it is as large as full);

  each compressed with zlib (level 1) and zstd (level 1 and 3, when ``zstandard`` imports);
- the seconds to encode (compare, gather, compress: what the trainer would do) and decode
  (decompress, scatter into the held version: what each server would do) on this CPU, one
  thread, checked bit-identical against the new version; and the seconds of a full send
  at stated link speeds, so that a delta pays on a link when
  ``encode + delta_bytes / link + decode < full_bytes / link``.

The tiny model is 3.4 MB, so per-call overheads dominate its encode/decode seconds;
``--tile-mb`` also times every codec on a buffer of that many MB made of the run's pairs one
after another (real change patterns and values, a size where throughput is the CPU's, not
Python's; compression runs in independent 1 MiB frames so no frame sees an earlier copy),
which with the pairs' median bytes gives each codec's break-even link speed.

How the versions are made (the default recipe, a checkpoint after every step; the second
run is the same recipe at lr 1e-6, the order of magnitude 7B+ RL recipes use, warm-started
from the first run's SFT model)::

    flock /tmp/heavy.lock python -m realscale train configs/tiny_cpu.yaml run.name=weight_delta \
        run.checkpoint_every=1 run.total_steps=30
    flock /tmp/heavy.lock python -m realscale train configs/tiny_cpu.yaml run.name=weight_delta_lr1e-6 \
        run.checkpoint_every=1 run.total_steps=10 optim.lr=1e-6 sft.output=runs/weight_delta/sft
    flock /tmp/heavy.lock python benchmarks/bench_weight_delta.py \
        --run runs/weight_delta --run runs/weight_delta_lr1e-6     # writes results/bench_weight_delta.json

Each run's versions are exported once (one gloo rank loads each checkpoint into a Megatron
engine and exports the HF-named weights in fp32, as a weight update does) into
``<run>/weight_versions.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

try:
    import zstandard
except ImportError:  # optional: zlib only
    zstandard = None

BLOCK = 4096
CHUNK = 1 << 20  # compression frame
# Link speeds (GB/s = 1e9 B/s) a full send is priced at: 10 GbE, 100 Gb/s NIC, 400 Gb/s NIC
# (one H100's InfiniBand rail), NVLink 4 one way (450 GB/s). Nominal, no efficiency factor.
LINKS = {"10GbE": 1.25, "100Gb": 12.5, "400Gb": 50.0, "NVLink": 450.0}


# ---------------------------------------------------------------- versions out of a run


def _export_rank(cfg_dict: dict, model_dir: str, ckpts: list[str], out_path: str) -> int:
    """One gloo rank: build the policy engine as the trainer does (inference only), export
    version 0, then load each checkpoint and export it; fp32 HF-named tensors to a file."""
    import torch

    from realscale.config import Config, config_from_dict
    from realscale.train.engine import EngineConfig, MegatronEngine

    cfg: Config = config_from_dict(cfg_dict)
    engine = MegatronEngine(EngineConfig.from_config(cfg, model_dir, train=False))

    def export() -> dict[str, torch.Tensor]:
        return {n: t.detach().to("cpu", copy=True) for bucket in engine.export_hf_weights(device="cpu")
                for n, t in bucket}

    versions = [export()]
    for ckpt in ckpts:
        engine.load(ckpt)
        versions.append(export())
    torch.save(versions, out_path)
    return len(versions)


def load_versions(run: str) -> tuple[list[dict], dict]:
    """The run's published versions 0..N (fp32, HF-named), exported once into a cache."""
    import torch
    from omegaconf import OmegaConf

    cache = os.path.join(run, "weight_versions.pt")
    root = os.path.join(run, "checkpoints")
    ckpts = sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("step") and d[4:].isdigit())
    steps = [int(os.path.basename(c)[4:]) for c in ckpts]
    if steps != list(range(1, len(steps) + 1)):
        raise SystemExit(f"{run}: need a checkpoint after every step (run.checkpoint_every=1), found {steps}")
    cfg_dict = OmegaConf.to_container(OmegaConf.load(os.path.join(run, "config.yaml")), resolve=True)
    if not os.path.exists(cache):
        from realscale.config import config_from_dict
        from realscale.parallel.spawn import run_distributed
        from realscale.sft import sft_output_dir

        cfg = config_from_dict(cfg_dict)
        model_dir = sft_output_dir(cfg) if cfg.model.path == "sft" else cfg.model.path
        model_dir = model_dir if os.path.isabs(model_dir) else os.path.join(ROOT, model_dir)
        run_distributed(_export_rank, 1, cfg_dict, model_dir, ckpts, cache + ".tmp", timeout=1800)
        os.replace(cache + ".tmp", cache)
    versions = torch.load(cache, weights_only=True)
    if len(versions) != len(ckpts) + 1:
        raise SystemExit(f"{cache}: {len(versions)} versions for {len(ckpts)} checkpoints; delete it")
    return versions, cfg_dict


# ---------------------------------------------------------------- codecs


def flat_bits(version: dict, dtype) -> tuple[np.ndarray, list[tuple[str, int, int]]]:  # noqa: F821
    """The whole version in ``dtype`` as one flat integer array of its bit patterns (int32
    for fp32, int16 for bf16), and each tensor's (name, start, numel) in it."""
    import torch

    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    parts, index, start = [], [], 0
    for name, t in version.items():
        parts.append(t.to(dtype).reshape(-1).view(view))
        index.append((name, start, t.numel()))
        start += t.numel()
    return torch.cat(parts).numpy().copy(), index


def compressors() -> dict:
    """name -> (compress(bytes) -> list of frames, decompress(frames) -> bytes). Each
    payload is compressed in independent 1 MiB frames, as a bucketed transport would (and
    so that no frame can reach back into an earlier copy of a tiled buffer)."""

    def chunked(fn):
        return lambda b: [fn(b[i:i + CHUNK]) for i in range(0, len(b), CHUNK)] or [fn(b"")]

    def joined(fn):
        return lambda frames: b"".join(fn(f) for f in frames)

    out = {"zlib1": (chunked(lambda b: zlib.compress(b, 1)), joined(zlib.decompress))}
    if zstandard is not None:
        for level in (1, 3):
            c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            out[f"zstd{level}"] = (chunked(c.compress), joined(d.decompress))
    return out


def codecs() -> dict:
    """name -> (encode(old, new) -> payload (list of bytes), decode(old, payload) -> new).
    Both take flat bit arrays (one dtype); decode writes into a copy of ``old``."""
    import numpy as np

    def tensor_codec(index):
        def enc(old, new):
            out = []
            for k, (_, s, n) in enumerate(index):
                if not np.array_equal(old[s:s + n], new[s:s + n]):
                    out += [np.int32(k).tobytes(), new[s:s + n].tobytes()]
            return out

        def dec(old, payload):
            res = old.copy()
            for i in range(0, len(payload), 2):
                _, s, n = index[int(np.frombuffer(payload[i], np.int32)[0])]
                res[s:s + n] = np.frombuffer(payload[i + 1], old.dtype)
            return res
        return enc, dec

    def sparse_enc(old, new):
        idx = np.flatnonzero(old != new).astype(np.int32)
        return [idx.tobytes(), new[idx].tobytes()]

    def sparse_dec(old, payload):
        res = old.copy()
        idx = np.frombuffer(payload[0], np.int32)
        res[idx] = np.frombuffer(payload[1], old.dtype)
        return res

    def gaps_enc(old, new):  # what gets compressed: index gaps (smaller numbers) + values
        idx = np.flatnonzero(old != new).astype(np.int32)
        gaps = np.diff(idx, prepend=np.int32(0)).astype(np.int32)
        return [gaps.tobytes(), new[idx].tobytes()]

    def gaps_dec(old, payload):
        res = old.copy()
        idx = np.cumsum(np.frombuffer(payload[0], np.int32), dtype=np.int64)
        res[idx] = np.frombuffer(payload[1], old.dtype)
        return res

    def _blocks(a):  # (blocks, per) view of a, zero-padded to whole blocks
        per = BLOCK // a.itemsize
        pad = (-a.size) % per
        return (np.concatenate([a, np.zeros(pad, a.dtype)]) if pad else a).reshape(-1, per)

    def block_enc(old, new):
        nb = _blocks(new)
        blocks = np.flatnonzero((_blocks(old) != nb).any(axis=1)).astype(np.int32)
        return [blocks.tobytes(), nb[blocks].tobytes()]

    def block_dec(old, payload):
        res = _blocks(old).copy()
        blocks = np.frombuffer(payload[0], np.int32)
        res[blocks] = np.frombuffer(payload[1], old.dtype).reshape(len(blocks), -1)
        return res.reshape(-1)[:old.size]

    def xor_enc(old, new):
        return [np.bitwise_xor(old, new).tobytes()]

    def xor_dec(old, payload):
        return np.bitwise_xor(old, np.frombuffer(payload[0], old.dtype))

    def full_enc(old, new):
        return [new.tobytes()]

    def full_dec(old, payload):
        return np.frombuffer(payload[0], old.dtype).copy()

    return {"full": (full_enc, full_dec), "tensor": tensor_codec, "sparse": (sparse_enc, sparse_dec),
            "sparse_gaps": (gaps_enc, gaps_dec), "block4k": (block_enc, block_dec), "xor": (xor_enc, xor_dec)}


# Which raw payloads are reported uncompressed (xor raw = full; gaps raw = sparse) and which compressed.
RAW = ("full", "tensor", "sparse", "block4k")
COMPRESSED = ("full", "tensor", "sparse_gaps", "block4k", "xor")


def measure_pair(old, new, index, repeats: int) -> dict:
    """Bytes and seconds of every codec for one pair of flat bit arrays."""
    import numpy as np

    full = old.size * old.itemsize
    cods = codecs()
    cods["tensor"] = cods["tensor"](index)
    comps = compressors()
    out: dict = {"full_bytes": full, "changed_frac": float(np.count_nonzero(old != new)) / old.size}
    for name, (enc, dec) in cods.items():
        variants = ([("raw", None)] if name in RAW else []) + \
                   ([(c, comps[c]) for c in comps] if name in COMPRESSED else [])
        for label, comp in variants:
            enc_t, dec_t, size = [], [], 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                payload = enc(old, new)
                if comp is not None:
                    payload = [comp[0](p) for p in payload]
                t1 = time.perf_counter()
                size = sum(sum(len(f) for f in p) if isinstance(p, list) else len(p) for p in payload)
                t2 = time.perf_counter()
                if comp is not None:
                    payload = [comp[1](p) for p in payload]
                res = dec(old, payload)
                t3 = time.perf_counter()
                enc_t.append(t1 - t0)
                dec_t.append(t3 - t2)
            if not np.array_equal(res, new):
                raise SystemExit(f"codec {name}/{label} did not reproduce the new version")
            # index overhead of the per-tensor codec counted as 4 B per tensor (already in payload)
            out[f"{name}/{label}"] = {"bytes": size, "ratio": size / full,
                                      "encode_s": statistics.median(enc_t), "decode_s": statistics.median(dec_t)}
    return out


def tiled(flats: list, mb: int):
    """(old, new) buffers of about ``mb`` MB made of the run's consecutive pairs one after
    another (pair 1, 2, ..., N, 1, ...): real change patterns, no copy repeated within a
    compression frame's reach."""
    import numpy as np

    size = flats[0].size * flats[0].itemsize
    reps = max(1, (mb << 20) // size)
    ks = [1 + i % (len(flats) - 1) for i in range(reps)]
    return np.concatenate([flats[k - 1] for k in ks]), np.concatenate([flats[k] for k in ks]), reps


# ---------------------------------------------------------------- analysis


def per_tensor_changes(old, new, index) -> dict[str, float]:
    import numpy as np

    return {name: float(np.count_nonzero(old[s:s + n] != new[s:s + n])) / n for name, s, n in index}


def analyse_run(run: str, repeats: int, tile_mb: int) -> dict:
    import torch

    torch.set_num_threads(1)
    versions, cfg = load_versions(run)
    metrics = []
    mpath = os.path.join(run, "metrics.jsonl")
    if os.path.exists(mpath):
        with open(mpath, encoding="utf-8") as fh:
            metrics = [json.loads(line) for line in fh if line.strip()]
    params = sum(t.numel() for t in versions[0].values())
    result = {"run": run, "lr": cfg["optim"]["lr"], "mini_batches": cfg["train"]["mini_batches"],
              "warmup_steps": cfg["optim"]["warmup_steps"], "params": params, "tensors": len(versions[0]),
              "versions": len(versions), "dtypes": {}}
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        flats = [flat_bits(v, dtype) for v in versions]
        index = flats[0][1]
        pairs = []
        for k in range(1, len(flats)):
            old, new = flats[k - 1][0], flats[k][0]
            row = {"pair": [k - 1, k], **measure_pair(old, new, index, repeats)}
            tensors = per_tensor_changes(old, new, index)
            row["tensors_changed"] = sum(1 for f in tensors.values() if f > 0)
            row["per_tensor_changed_frac"] = {n: round(f, 5) for n, f in tensors.items()}
            # the abs(Δ) of the fp32 master weights that the pair carries, for the bf16 picture
            if dname == "fp32":
                d = torch.cat([(versions[k][n] - versions[k - 1][n]).reshape(-1) for n in versions[k]]).abs()
                w = torch.cat([versions[k - 1][n].reshape(-1) for n in versions[k]]).abs()
                rel = d / w.clamp_min(1e-12)
                row["update_abs_median"] = float(d.median())
                row["update_rel_median"] = float(rel.median())
            pairs.append(row)
            print(f"{run} {dname} {k - 1}->{k}: changed {row['changed_frac']:.4f}, "
                  f"sparse {row['sparse/raw']['ratio']:.3f}, xor/zstd3 "
                  f"{row.get('xor/zstd3', row['xor/zlib1'])['ratio']:.3f} of full", flush=True)
        entry: dict = {"pairs": pairs}
        # throughput on a tiled buffer: the run's pairs one after another
        big_old, big_new, reps = tiled([f[0] for f in flats], tile_mb)
        n0 = flats[0][0].size
        big_index = [(f"t{i}", i * n0 + s, n) for i in range(reps) for _, s, n in index]
        t = measure_pair(big_old, big_new, big_index, repeats=1)
        entry["tiled"] = {"mb": big_old.size * big_old.itemsize / 1e6, "reps": reps, **t}
        result["dtypes"][dname] = entry
    result["steps"] = [{"step": m.get("step"), "version": m.get("version"), "lr": m.get("train/lr"),
                        "grad_norm": m.get("train/grad_norm")} for m in metrics]
    return result


def summarise(result: dict) -> dict:
    """Medians over pairs (and over pairs after the first, where warm-up ends) per codec,
    break-even link speeds from the tiled throughput."""
    out = {}
    for dname, entry in result["dtypes"].items():
        pairs = entry["pairs"]
        keys = [k for k in pairs[0] if "/" in k]
        s: dict = {"changed_frac_median": statistics.median(p["changed_frac"] for p in pairs),
                   "changed_frac_min": min(p["changed_frac"] for p in pairs),
                   "changed_frac_max": max(p["changed_frac"] for p in pairs),
                   "changed_frac_first_pair": pairs[0]["changed_frac"],
                   "full_bytes": pairs[0]["full_bytes"], "codecs": {}}
        tile = entry["tiled"]
        for key in keys:
            ratio = statistics.median(p[key]["ratio"] for p in pairs)
            tb = tile["full_bytes"]
            enc_rate = tb / tile[key]["encode_s"]  # model bytes per second through the codec
            dec_rate = tb / tile[key]["decode_s"]
            tratio = ratio  # bytes from the real pairs; the tiled buffer only times the codec
            # delta pays on a link of L B/s iff B/enc + r*B/L + B/dec < B/L  <=>  L < (1-r)/(1/enc+1/dec)
            breakeven = (1 - tratio) / (1 / enc_rate + 1 / dec_rate) if tratio < 1 else 0.0
            c = {"ratio_median": ratio, "ratio_max": max(p[key]["ratio"] for p in pairs),
                 "tiled_ratio": tratio, "encode_GBps": enc_rate / 1e9, "decode_GBps": dec_rate / 1e9,
                 "breakeven_link_GBps": breakeven / 1e9, "links": {}}
            for lname, gbps in LINKS.items():
                L = gbps * 1e9
                full_s = tb / L
                delta_s = tile[key]["encode_s"] + tratio * tb / L + tile[key]["decode_s"]
                c["links"][lname] = {"full_s_per_GB": full_s / (tb / 1e9), "delta_s_per_GB": delta_s / (tb / 1e9)}
            s["codecs"][key] = c
        out[dname] = s
    return out


def table(result: dict, summary: dict) -> str:
    lines = [(f"{result['run']} (lr {result['lr']:g}, {result['params']:,} parameters, "
              f"{result['versions'] - 1} consecutive pairs)")]
    for dname, s in summary.items():
        lines.append(f"  {dname}: elements changed per version: median {s['changed_frac_median']:.4f} "
                     f"(min {s['changed_frac_min']:.4f}, max {s['changed_frac_max']:.4f}, "
                     f"first pair {s['changed_frac_first_pair']:.4f}); full {s['full_bytes'] / 1e6:.2f} MB")
        lines.append(f"    {'codec':18} {'bytes/full':>10} {'enc GB/s':>9} {'dec GB/s':>9} {'pays below':>11}")
        for key, c in s["codecs"].items():
            lines.append(f"    {key:18} {c['ratio_median']:10.3f} {c['encode_GBps']:9.3f} {c['decode_GBps']:9.3f} "
                         f"{c['breakeven_link_GBps']:8.3f} GB/s")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", help="a run directory with a checkpoint after every step")
    ap.add_argument("--repeats", type=int, default=3, help="timed encode/decode repeats per pair (median)")
    ap.add_argument("--tile-mb", type=int, default=256, help="size of the tiled buffer for throughput")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_weight_delta.json"))
    args = ap.parse_args()
    runs = args.run or [os.path.join(ROOT, "runs", "weight_delta")]
    uptime_start = os.popen("uptime").read().strip()
    results = []
    for run in runs:
        r = analyse_run(run, args.repeats, args.tile_mb)
        r["summary"] = summarise(r)
        print(table(r, r["summary"]), flush=True)
        results.append(r)
    doc = {"benchmark": "bench_weight_delta", "uptime_start": uptime_start, "uptime": os.popen("uptime").read().strip(),
           "cpu_threads": 1, "zstandard": getattr(zstandard, "__version__", None), "block_bytes": BLOCK,
           "links_GBps": LINKS, "runs": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, separators=(",", ":"))  # every pair x codec: compact
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

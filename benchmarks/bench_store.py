"""Shard write/read throughput and size against `numpy.save` of the same arrays.

Workload: 16 executions of the paper's case-study shape (4 tasks x 4, ~9M stored tokens), packed
once into the shard's five arrays. "Raw" is `numpy.save` of those same arrays, one .npy each,
then fsync: a shard is always fsynced (ARCHITECTURE.md invariant 5), so that is the like-for-like
baseline; `*_nosync` figures compare against `numpy.save` left in the page cache. The shard
side is `ShardWriter.write_packed` (tmp file, checksums, fsync, rename); `*_end_to_end` adds
packing the ExecutionRecords. Read is `read_shard` with checksum verification and trees rebuilt,
against `numpy.load` of the raw files. Each figure is the best of interleaved repetitions, so
load from other processes on the machine hits both sides alike.

Every compression in SWEEP is measured (keys `<tag>_...`); the top-level figures are for the
`StoreConfig` defaults. Writes benchmarks/results/store.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.config import StoreConfig  # noqa: E402
from gyre.fsio import fsync_path  # noqa: E402
from gyre.traj.store import ShardWriter, pack, read_shard  # noqa: E402
from gyre.traj.synthetic import case_study  # noqa: E402

EXECUTIONS = 16
REPS = 5
IDENTITY = {"tokenizer": "bench-tokenizer", "model": "bench-model"}
# tag -> (compression, level, chunk_tokens)
SWEEP = {
    "lzf": ("lzf", 1, 1 << 16), "gzip1": ("gzip", 1, 1 << 16), "gzip4": ("gzip", 4, 1 << 16),
    "none_chunk14": ("none", 1, 1 << 14), "none_chunk18": ("none", 1, 1 << 18),
}


def npy_write(arrays: dict[str, np.ndarray], d: Path, sync: bool) -> float:
    t = time.perf_counter()
    for name, arr in arrays.items():
        p = d / f"{name}.npy"
        np.save(p, arr)
        if sync:
            fsync_path(p)
    if sync:
        fsync_path(d)
    return time.perf_counter() - t


def npy_read(arrays: dict[str, np.ndarray], d: Path) -> float:
    t = time.perf_counter()
    for name in arrays:
        np.load(d / f"{name}.npy")
    return time.perf_counter() - t


def measure(tag: str, cfg: tuple, arrays: dict, records: list, work: Path, reps: int) -> dict:
    comp, level, chunk = cfg
    w = ShardWriter(work / tag, comp, level, chunk, False, IDENTITY)
    raw = work / "raw"
    raw.mkdir(exist_ok=True)
    t_npy, t_npy_nosync, t_shard, t_read, t_npy_read = [], [], [], [], []
    path = None
    for _ in range(reps):  # interleaved so both sides see the same machine load
        t_npy_nosync.append(npy_write(arrays, raw, sync=False))
        t_npy.append(npy_write(arrays, raw, sync=True))
        if path is not None:
            path.unlink()
        t = time.perf_counter()
        path = w.write_packed(arrays)
        t_shard.append(time.perf_counter() - t)
        t_npy_read.append(npy_read(arrays, raw))
        t = time.perf_counter()
        read_shard(path, verify=True)
        t_read.append(time.perf_counter() - t)
    path.unlink()
    t = time.perf_counter()
    path = w.write(records)  # end to end: records -> pack -> durable shard
    t_e2e = time.perf_counter() - t
    n = len(arrays["tokens"])
    raw_bytes = sum((raw / f"{k}.npy").stat().st_size for k in arrays)
    shard_bytes = path.stat().st_size
    return {
        "write_ratio": min(t_npy) / min(t_shard),
        "write_ratio_nosync": min(t_npy_nosync) / min(t_shard),
        "write_ratio_end_to_end": min(t_npy) / t_e2e,
        "size_ratio": shard_bytes / raw_bytes,
        "read_tokens_per_s": n / min(t_read),
        "read_ratio": min(t_npy_read) / min(t_read),
        "write_tokens_per_s": n / min(t_shard),
        "write_end_to_end_tokens_per_s": n / t_e2e,
        "npy_write_tokens_per_s": n / min(t_npy),
        "npy_write_nosync_tokens_per_s": n / min(t_npy_nosync),
        "npy_read_tokens_per_s": n / min(t_npy_read),
        "shard_bytes": shard_bytes, "raw_bytes": raw_bytes,
        "bytes_per_token": shard_bytes / n, "raw_bytes_per_token": raw_bytes / n,
    }


def main() -> dict:
    # np.save warns that h5py's string metadata on the table dtypes is not kept: irrelevant here
    warnings.filterwarnings("ignore", message="metadata on a dtype")
    t0 = time.perf_counter()
    records = [case_study(seed=s, execution_id=f"case-{s}", task=f"task-{s // 4}", group=s // 4)
               for s in range(EXECUTIONS)]
    arrays = pack(records)
    default = StoreConfig()
    dflt = (default.compression, default.compression_level, default.chunk_tokens)
    out: dict = {"executions": EXECUTIONS, "tokens": int(len(arrays["tokens"])),
                 "target_tokens": int(len(arrays["logprobs"])), "nodes": int(len(arrays["nodes"])),
                 "calls": int(len(arrays["calls"])), "compression": dflt[0],
                 "compression_level": dflt[1], "chunk_tokens": dflt[2]}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-store-") as tmp:
        work = Path(tmp)
        out.update(measure("default", dflt, arrays, records, work, REPS))
        for tag, cfg in SWEEP.items():
            figures = measure(tag, cfg, arrays, records, work, 2)
            for k in ("write_ratio", "write_ratio_nosync", "size_ratio", "read_tokens_per_s",
                      "write_tokens_per_s"):
                out[f"{tag}_{k}"] = figures[k]
    out["seconds"] = time.perf_counter() - t0
    out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}
    dest = ROOT / "benchmarks" / "results" / "store.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    result = main()
    for k in ("write_ratio", "write_ratio_nosync", "size_ratio", "read_tokens_per_s", "seconds"):
        print(f"{k:>22}: {result[k]}")
    print(f"wrote {ROOT / 'benchmarks/results/store.json'}")

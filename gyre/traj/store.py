"""HDF5 trajectory shards: many executions per file in flat, chunked datasets (schema.md).

Writing follows ARCHITECTURE.md invariant 5: a shard is built under ``<name>.tmp`` in the
target directory, flushed, fsynced, renamed and the directory fsynced, so a crash leaves either
no shard or a whole one; readers never look at ``*.tmp``. Drivers write each finished execution
as its own small shard before acknowledging it (invariant 7) and merge them later with
``compact``: a compacted shard (``*.c.h5``) names its sources in the ``compacted_from``
attribute and readers skip any source still on disk, so a crash mid-compaction shows every
execution exactly once. Every dataset carries a sha256 of its
canonical bytes in the file attributes; a reader that finds a bad shard raises ``ShardError``
naming the file and the dataset, and ``iter_executions`` reports it and goes on to the next.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import itertools
import json
import logging
import operator
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import h5py
import numpy as np

import gyre
from gyre import faults
from gyre.config import Compression
from gyre.fsio import atomic_path, fsync_path
from gyre.traj.record import ExecutionRecord
from gyre.traj.routing import RoutingTable, storage_dtype
from gyre.traj.tree import CallRecord, Node, TrajectoryTree

log = logging.getLogger(__name__)

SCHEMA = "gyre-trajectory-shard"
SCHEMA_VERSION = 2  # 2: calls carry their sampling parameters and output digest
READABLE_VERSIONS = (1, SCHEMA_VERSION)
REQUIRED_IDENTITY = ("tokenizer", "model")
STR = "str"  # a fixed-width UTF-8 string column; the width is the longest value in the shard

# Tables are compound datasets (a spreadsheet in HDFView). Strings are fixed-width UTF-8
# rather than variable-length: HDFView shows them as text all the same, they compress with
# the rest of the row, and they write about 5x faster (no global-heap object per value).
NODE_COLUMNS = (
    ("execution", "<i4"), ("node", "<i4"), ("parent", "<i4"),
    ("token_start", "<i8"), ("length", "<i4"), ("target_start", "<i4"), ("logprob_start", "<i8"),
    ("message_role", STR), ("agent_role", STR), ("target", "?"),
    ("policy_version", "<i4"), ("call_index", "<i4"), ("key", STR),
)
CALL_COLUMNS = (
    ("execution", "<i4"), ("call", "<i4"), ("leaf", "<i4"), ("agent_role", STR),
    ("n_input", "<i4"), ("n_output", "<i4"), ("weight_version", STR), ("policy_version", "<i4"),
    ("endpoint", STR), ("finish_reason", STR), ("t_start", "<f8"), ("t_end", "<f8"),
    ("temperature", "<f8"), ("top_p", "<f8"), ("top_k", "<i4"), ("min_p", "<f8"), ("output_digest", "<i8"),
)
# schema 1 shards lack the last five call columns; they read as the engine's defaults (see _records)
CALL_COLUMNS_V1 = CALL_COLUMNS[:12]
CALL_DEFAULTS_V1 = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "output_digest": 0}
EXECUTION_COLUMNS = (
    ("execution_id", STR), ("task", STR), ("group", "<i8"), ("status", STR),
    ("reward", "<f8"), ("reward_source", STR), ("passed", "<i4"), ("total", "<i4"),
    ("min_version", "<i4"), ("max_version", "<i4"), ("t_start", "<f8"), ("t_end", "<f8"),
    ("workspace", STR), ("node_start", "<i8"), ("node_count", "<i4"),
    ("call_start", "<i8"), ("call_count", "<i4"), ("error", STR),
)
# columns added since: a shard written before lacks them and reads as None
LATER_COLUMNS = {"executions": ("error",)}
# optional (routing replay): one row per (node, policy version) entry of a tree's RoutingTable,
# its expert ids at routed_experts[row_start:row_start + rows]
ROUTING_COLUMNS = (
    ("execution", "<i4"), ("node", "<i4"), ("policy_version", "<i4"), ("row_start", "<i8"), ("rows", "<i4"),
)
TABLES = {"nodes": NODE_COLUMNS, "calls": CALL_COLUMNS, "executions": EXECUTION_COLUMNS,
          "routing": ROUTING_COLUMNS}
BULK = {"tokens": np.dtype("<i4"), "logprobs": np.dtype("<f4")}
DATASETS = ("tokens", "logprobs", "nodes", "calls", "executions")
OPTIONAL = ("routing", "routed_experts")  # absent in shards recorded without routing replay
TABLE_CHUNK_ROWS = 8192
TABLE_GZIP_LEVEL = 1  # as small as level 9 within 5% on these rows, and 2x faster
_seq = itertools.count()  # process-wide, so two writers in one process never share a name


class ShardError(Exception):
    """A shard that cannot be trusted: names the file and the dataset (or attribute) at fault."""

    def __init__(self, path: str | os.PathLike, dataset: str, reason: str):
        self.path, self.dataset, self.reason = str(path), dataset, reason
        super().__init__(f"{self.path}: {dataset}: {reason}")


class Parts:
    """A bulk dataset as the per-node arrays that hold it, in order: written chunk by chunk and
    checksummed part by part, never concatenated (a 1M-token execution is not copied whole)."""

    def __init__(self, arrays: list[np.ndarray], dtype: str):
        self.arrays, self.dtype = arrays, np.dtype(dtype)
        self.n = int(sum(len(a) for a in arrays))

    def __len__(self) -> int:
        return self.n

    def chunks(self, rows: int) -> Iterator[np.ndarray]:
        """The data in consecutive blocks of ``rows`` (the last one shorter), through one buffer."""
        buf, fill = np.empty(rows, self.dtype), 0
        for a in self.arrays:
            at = 0
            while at < len(a):
                n = min(rows - fill, len(a) - at)
                buf[fill:fill + n] = a[at:at + n]
                fill, at = fill + n, at + n
                if fill == rows:
                    yield buf
                    fill = 0
        if fill:
            yield buf[:fill]


# -- canonical bytes and checksums ----------------------------------------------------------
def _le_bytes(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col, col.dtype.newbyteorder("<") if col.dtype.kind in "iuf" else col.dtype)


def digest(arr: "np.ndarray | Parts") -> str:
    """sha256 of a dataset's canonical bytes: a plain array's little-endian bytes; a table's
    columns in order, each as name + NUL + its little-endian (strings: NUL-padded) bytes."""
    h = hashlib.sha256()
    if isinstance(arr, Parts):  # the same bytes as the concatenated array's
        for a in arr.arrays:
            h.update(_le_bytes(np.asarray(a, arr.dtype)))
        return h.hexdigest()
    if arr.dtype.names is None:
        h.update(_le_bytes(arr))
        return h.hexdigest()
    for name in arr.dtype.names:
        h.update(name.encode() + b"\0")
        h.update(_le_bytes(arr[name]))
    return h.hexdigest()


def _deflate_chunks(arr: np.ndarray, rows: int) -> list[bytes]:
    """``arr`` cut into HDF5 chunks of ``rows`` and run through the shuffle + deflate filters
    exactly as HDF5 would (for ``write_direct_chunk``); the last chunk is zero-padded."""
    size = arr.dtype.itemsize
    raw = np.frombuffer(arr.tobytes(), np.uint8).reshape(len(arr), size)
    out = []
    for start in range(0, len(arr), rows):
        block = np.zeros((rows, size), np.uint8)
        part = raw[start:start + rows]
        block[:len(part)] = part
        out.append(zlib.compress(block.T.tobytes(), TABLE_GZIP_LEVEL))  # shuffle = byte transpose
    return out


def _table(columns: tuple, values: dict[str, object], n: int) -> np.ndarray:
    """A packed structured array for ``columns`` from per-column values."""
    cols, fields = {}, []
    for name, kind in columns:
        if kind == STR:
            enc = [v.encode("utf-8") for v in values[name]]
            width = max(1, max(map(len, enc), default=1))
            cols[name] = np.array(enc, dtype=f"S{width}") if enc else np.zeros(0, f"S{width}")
            fields.append((name, h5py.string_dtype("utf-8", width)))
        else:
            cols[name] = values[name]
            fields.append((name, np.dtype(kind)))
    out = np.empty(n, np.dtype(fields))
    for name, col in cols.items():
        out[name] = col
    return out


# -- packing records into flat arrays -------------------------------------------------------
_NODE_FIELDS = operator.attrgetter("id", "parent", "target_start", "policy_version", "call_index",
                                   "message_role", "agent_role", "key")
_CALL_FIELDS = tuple(name for name, _ in CALL_COLUMNS if name != "execution")
_CALL_GET = operator.attrgetter(*("index" if f == "call" else f for f in _CALL_FIELDS))


def pack(records: list[ExecutionRecord], concat: bool = True) -> dict[str, "np.ndarray | Parts"]:
    """The shard's five datasets for ``records``, in shard order; ``concat=False``: the bulk
    ``tokens``/``logprobs`` as `Parts` of the nodes' own arrays (what `ShardWriter.write` uses)."""
    all_nodes = [n for r in records for n in r.tree.nodes]
    all_calls = [c for r in records for c in r.tree.calls]
    n_nodes = np.array([len(r.tree.nodes) for r in records], np.int64)
    n_calls = np.array([len(r.tree.calls) for r in records], np.int64)
    tok_parts = [n.tokens for n in all_nodes]
    lp_parts = [n.logprobs for n in all_nodes]
    lengths = np.fromiter(map(len, tok_parts), np.int64, len(all_nodes))
    n_lp = np.fromiter(map(len, lp_parts), np.int64, len(all_nodes))
    cols = list(zip(*map(_NODE_FIELDS, all_nodes))) or [()] * 8
    ids, parents, tstarts, pvs, cidx, mroles, aroles, keys = cols
    n_targets = lengths - np.asarray(tstarts, np.int64)
    bad = np.flatnonzero(n_lp != n_targets)
    if len(bad):
        i = bad[0]
        raise ValueError(f"node {ids[i]}: {n_lp[i]} log-probs for {n_targets[i]} target tokens")

    nt = _table(NODE_COLUMNS, {
        "execution": np.repeat(np.arange(len(records)), n_nodes), "node": ids, "parent": parents,
        "token_start": np.cumsum(lengths) - lengths, "length": lengths, "target_start": tstarts,
        "logprob_start": np.cumsum(n_targets) - n_targets, "message_role": mroles,
        "agent_role": aroles, "target": n_targets > 0, "policy_version": pvs, "call_index": cidx,
        "key": keys,
    }, len(all_nodes))
    call_cols = list(zip(*map(_CALL_GET, all_calls))) or [()] * len(_CALL_FIELDS)
    cv: dict[str, object] = dict(zip(_CALL_FIELDS, call_cols))
    cv["execution"] = np.repeat(np.arange(len(records)), n_calls)
    ct = _table(CALL_COLUMNS, cv, len(all_calls))
    ev: dict[str, object] = {name: [getattr(r, name) for r in records] for name in (
        "execution_id", "task", "group", "status", "reward", "reward_source", "passed", "total",
        "min_version", "max_version", "t_start", "t_end", "workspace")}
    ev["error"] = [r.error or "" for r in records]
    ev.update(node_start=np.cumsum(n_nodes) - n_nodes, node_count=n_nodes,
              call_start=np.cumsum(n_calls) - n_calls, call_count=n_calls)
    et = _table(EXECUTION_COLUMNS, ev, len(records))
    if not concat:
        return {"tokens": Parts(tok_parts, "<i4"), "logprobs": Parts(lp_parts, "<f4"),
                "nodes": nt, "calls": ct, "executions": et, **_pack_routing(records)}
    return {
        "tokens": np.concatenate(tok_parts, dtype="<i4") if tok_parts else np.zeros(0, "<i4"),
        "logprobs": np.concatenate(lp_parts, dtype="<f4") if lp_parts else np.zeros(0, "<f4"),
        "nodes": nt, "calls": ct, "executions": et, **_pack_routing(records),
    }


def _pack_routing(records: list[ExecutionRecord]) -> dict[str, np.ndarray]:
    """The optional ``routing`` table and ``routed_experts`` [rows, MoE layers, top_k] of the
    records' routing tables; {} when none has one. One model per shard: shapes must agree."""
    tables = [(i, r.tree.routing) for i, r in enumerate(records) if r.tree.routing is not None]
    if not tables:
        return {}
    shape = {(t.moe_layers, t.top_k) for _, t in tables}
    if len(shape) > 1:
        raise ValueError(f"executions routed with different MoE shapes {sorted(shape)} in one shard")
    (layers, top_k), = shape
    dtype = storage_dtype(max(t.n_experts for _, t in tables))
    keys = [(i, n, v) for i, t in tables for (n, v) in sorted(t.entries)]
    parts = [records[i].tree.routing.entries[(n, v)] for i, n, v in keys]
    lengths = np.fromiter(map(len, parts), np.int64, len(parts))
    cols = list(zip(*keys)) or [()] * 3
    table = _table(ROUTING_COLUMNS, {"execution": cols[0], "node": cols[1], "policy_version": cols[2],
                                     "row_start": np.cumsum(lengths) - lengths, "rows": lengths}, len(keys))
    rows = np.concatenate(parts).astype(dtype) if parts else np.zeros((0, layers, top_k), dtype)
    return {"routing": table, "routed_experts": rows}


# -- writing --------------------------------------------------------------------------------
DESCRIPTIONS = {
    "tokens": "int32 token ids of every node of every execution, concatenated (nodes.token_start/length)",
    "logprobs": "float32 behaviour log-probs of target tokens only, concatenated (nodes.logprob_start)",
    "nodes": "one row per tree node; parent and node are per-execution ids (-1 = root)",
    "calls": "one row per model call; leaf is the per-execution id of the node it produced",
    "executions": "one row per execution; node_start/node_count and call_start/call_count index the tables",
    "routing": "optional: one row per (node, policy version) routed by the engine; routed_experts rows "
               "row_start..row_start+rows are the node's first positions",
    "routed_experts": "optional: expert ids [rows, MoE layers, top_k] the engine routed each position to",
}


def shard_identity(identity: dict) -> dict:
    """A model identity (gyre.model.identity.model_identity) as shard attributes name it:
    what the executions of a shard were sampled from."""
    return {"model": identity.get("model_hash", ""), "tokenizer": identity.get("tokenizer_hash", ""),
            "model_name": identity.get("name", "")}


@dataclass
class ShardWriter:
    """Writes lists of executions as new shards in ``dir`` (one file per ``write``).

    ``compression`` applies to the bulk ``tokens``/``logprobs`` arrays ("gzip", "lzf" or "none",
    with the shuffle filter when compressing; defaults as in ``StoreConfig``, chosen from
    benchmarks/results/store.json); the tables are always deflated (small, very repetitive).
    ``locking`` is HDF5 file locking, off by default because Lustre/GPFS mounts without flock
    make HDF5 fail to open files.
    """

    dir: str | os.PathLike
    compression: str = "none"
    level: int = 1
    chunk_tokens: int = 1 << 16
    locking: bool = False
    identity: dict | None = None

    def __post_init__(self) -> None:
        self.dir = Path(self.dir)
        if self.compression not in tuple(Compression):
            raise ValueError(f"compression {self.compression!r}: choose gzip, lzf or none")
        missing = [k for k in REQUIRED_IDENTITY if not (self.identity or {}).get(k)]
        if missing:
            raise ValueError(f"identity must name the {' and '.join(missing)} (hashes); "
                             f"got {self.identity!r}")

    @classmethod
    def from_config(cls, cfg, directory: str | os.PathLike, identity: dict) -> "ShardWriter":
        """From a ``gyre.config.StoreConfig``."""
        return cls(directory, cfg.compression, cfg.compression_level, cfg.chunk_tokens,
                   cfg.hdf5_locking, identity)

    def _new_name(self, suffix: str = ".h5") -> tuple[Path, Path]:
        # time first so names sort in write order; seq and pid make them unique
        while True:
            now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
            final = self.dir / f"shard-{now}-{next(_seq):06d}-{os.getpid()}{suffix}"
            tmp = final.with_name(final.name + ".tmp")
            if final.exists():
                continue
            try:  # O_EXCL: nobody else writes this temp file; 0600: shards are private
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                continue
            return final, tmp

    def _bulk_filters(self) -> dict:
        if self.compression == Compression.GZIP:
            return {"compression": "gzip", "compression_opts": self.level, "shuffle": True}
        if self.compression == Compression.LZF:
            return {"compression": "lzf", "shuffle": True}
        return {}

    def write(self, records: list[ExecutionRecord], extra_attrs: dict | None = None,
              suffix: str = ".h5") -> Path:
        """Write ``records`` as one new shard; returns its final path."""
        if not records:
            raise ValueError("no executions to write")
        return self.write_packed(pack(records, concat=False), extra_attrs, suffix)

    def write_packed(self, data: dict[str, "np.ndarray | Parts"], extra_attrs: dict | None = None,
                     suffix: str = ".h5") -> Path:
        """Write already packed datasets (``pack``) as one new shard."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        final, tmp = self._new_name(suffix)
        # hashlib and zlib release the GIL: checksums and table compression run in threads
        # while the main thread writes the bulk arrays through HDF5
        with ThreadPoolExecutor(max_workers=2) as pool:
            digests = {name: pool.submit(digest, arr) for name, arr in data.items()}
            chunks = {name: pool.submit(_deflate_chunks, data[name], self._table_rows(data[name]))
                      for name in TABLES if name in data}
            with atomic_path(final, mode=0o600, tmp=tmp):
                with h5py.File(tmp, "w", locking=self.locking) as f:
                    for name in DATASETS + tuple(n for n in OPTIONAL if n in data):
                        deflated = None if name in BULK or name == "routed_experts" else chunks[name].result()
                        ds = self._create(f, name, data[name], deflated)
                        ds.attrs["description"] = DESCRIPTIONS[name]
                    f.attrs.update(self._file_attrs(data))
                    f.attrs.update(extra_attrs or {})
                    f.attrs.update({f"sha256_{k}": v.result() for k, v in digests.items()})
                    f.flush()
        return final

    @staticmethod
    def _table_rows(arr: np.ndarray) -> int:
        return max(1, min(len(arr), TABLE_CHUNK_ROWS))

    def _create(self, f: h5py.File, name: str, arr: "np.ndarray | Parts", deflated: list[bytes] | None) -> h5py.Dataset:
        # maxshape None: an empty dataset still gets a valid (1-row) chunk
        if isinstance(arr, Parts):  # chunk-aligned blocks straight from the nodes' arrays
            rows = max(1, min(len(arr), self.chunk_tokens))
            ds = f.create_dataset(name, shape=(len(arr),), dtype=arr.dtype, chunks=(rows,), maxshape=(None,),
                                  **self._bulk_filters())
            at = 0
            for block in arr.chunks(rows):
                ds.write_direct(block, dest_sel=np.s_[at:at + len(block)])
                at += len(block)
            return ds
        if deflated is None:
            rows = max(1, min(len(arr), self.chunk_tokens))
            return f.create_dataset(name, data=arr, chunks=(rows, *arr.shape[1:]),
                                    maxshape=(None, *arr.shape[1:]), **self._bulk_filters())
        rows = self._table_rows(arr)
        ds = f.create_dataset(name, shape=arr.shape, dtype=arr.dtype, chunks=(rows,), maxshape=(None,),
                              compression="gzip", compression_opts=TABLE_GZIP_LEVEL, shuffle=True)
        for k, blob in enumerate(deflated):
            ds.id.write_direct_chunk((k * rows,), blob)
        return ds

    def _file_attrs(self, data: dict[str, np.ndarray]) -> dict:
        now = _dt.datetime.now(_dt.timezone.utc)
        attrs = {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "gyre_version": gyre.__version__,
            "created": now.isoformat(timespec="seconds"), "created_unix": now.timestamp(),
            "n_executions": len(data["executions"]), "n_calls": len(data["calls"]),
            "n_nodes": len(data["nodes"]), "n_tokens": len(data["tokens"]),
        }
        attrs.update({f"identity_{k}": str(v) for k, v in (self.identity or {}).items()})
        return attrs


# -- reading --------------------------------------------------------------------------------
def _s(v: object) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _attr(path: Path, f: h5py.File, name: str) -> object:
    try:
        return f.attrs.get(name)
    except Exception as e:
        raise ShardError(path, f"attribute {name}", f"unreadable (corrupted?): {e}") from None


def _read_all(path: Path, f: h5py.File, verify: bool) -> dict[str, np.ndarray]:
    ver = _attr(path, f, "schema_version")
    if ver is None:
        raise ShardError(path, "attribute schema_version", "missing: not a Gyre trajectory shard")
    if int(ver) not in READABLE_VERSIONS:
        raise ShardError(path, "attribute schema_version",
                         f"schema version {int(ver)}; this reader understands {', '.join(map(str, READABLE_VERSIONS))}")
    if int(ver) == 1:
        log.warning("%s: schema 1 shard: its calls carry no sampling parameters (read as temperature 1, "
                    "top_p 1, top_k -1, min_p 0: log-probs sampled otherwise are not reproduced in "
                    "training) and no output digest (the token-identity audit skips them)", path)
    data = {}
    for name in DATASETS + OPTIONAL:
        try:
            present = name in f
        except Exception as e:
            raise ShardError(path, name, f"unreadable (corrupted?): {e}") from None
        if not present:
            if name in OPTIONAL:
                continue
            raise ShardError(path, name, "missing dataset")
        try:
            arr = f[name][()]
        except Exception as e:  # h5py raises OSError, ValueError, RuntimeError... on damage
            raise ShardError(path, name, f"unreadable (corrupted?): {e}") from None
        _check_layout(path, name, arr, int(ver))
        if verify:
            want = _attr(path, f, f"sha256_{name}")
            if want is None:
                raise ShardError(path, f"attribute sha256_{name}", "missing checksum")
            got = digest(arr)
            if got != _s(want):
                raise ShardError(path, name, f"checksum mismatch: stored sha256 {_s(want)[:16]}..., "
                                             f"data has {got[:16]}...")
        data[name] = arr
    return data


def _check_layout(path: Path, name: str, arr: np.ndarray, version: int = SCHEMA_VERSION) -> None:
    if name == "routed_experts":
        if arr.ndim != 3 or arr.dtype not in (np.uint8, np.uint16):
            raise ShardError(path, name, f"expected uint8/uint16 [rows, layers, top_k], found {arr.dtype} "
                                         f"{arr.shape}")
        return
    if arr.ndim != 1:
        raise ShardError(path, name, f"expected one dimension, found shape {arr.shape}")
    if name in BULK:
        if arr.dtype != BULK[name]:
            raise ShardError(path, name, f"expected {BULK[name]}, found {arr.dtype}")
        return
    for col, kind in (CALL_COLUMNS_V1 if name == "calls" and version == 1 else TABLES[name]):
        if arr.dtype.names is None or col not in arr.dtype.names:
            if arr.dtype.names is not None and col in LATER_COLUMNS.get(name, ()):
                continue
            raise ShardError(path, name, f"missing column {col!r}")
        got = arr.dtype.fields[col][0]
        if (got.kind != "S") if kind == STR else (got != np.dtype(kind)):
            want = "string" if kind == STR else kind
            raise ShardError(path, name, f"column {col!r} is {got}, expected {want}")


def _routing_tables(path: Path, d: dict[str, np.ndarray], n_exec: int) -> dict[int, RoutingTable]:
    """Each execution's RoutingTable from the optional datasets ({} when the shard has none)."""
    if ("routing" in d) != ("routed_experts" in d):
        raise ShardError(path, "routing", "routing and routed_experts must come together")
    if "routing" not in d:
        return {}
    rt, rows = d["routing"], d["routed_experts"]
    ends = rt["row_start"] + rt["rows"]
    if len(rt) and (rt["row_start"].min() < 0 or ends.max() > len(rows) or rt["execution"].max() >= n_exec):
        raise ShardError(path, "routing", "row range outside routed_experts, or an unknown execution")
    n_experts = 256 if rows.dtype == np.uint8 else 65536
    out: dict[int, RoutingTable] = {}
    for e, n, v, s, ln in zip(*(rt[k].tolist() for k in ("execution", "node", "policy_version", "row_start", "rows"))):
        table = out.setdefault(e, RoutingTable(rows.shape[1], rows.shape[2], n_experts))
        table.put(n, v, rows[s:s + ln])
    return out


def _records(path: Path, d: dict[str, np.ndarray]) -> list[ExecutionRecord]:
    tokens, logprobs, nt, ct, et = (d[k] for k in DATASETS)
    routing = _routing_tables(path, d, len(et))
    ends = nt["token_start"] + nt["length"]
    if len(nt) and (nt["token_start"].min() < 0 or ends.max() > len(tokens)):
        raise ShardError(path, "nodes", "token range outside the tokens dataset")
    lp_ends = nt["logprob_start"] + (nt["length"] - nt["target_start"])
    if len(nt) and (nt["logprob_start"].min() < 0 or lp_ends.max() > len(logprobs)):
        raise ShardError(path, "nodes", "log-prob range outside the logprobs dataset")
    out = []
    for ei, e in enumerate(et):
        n0, nn = int(e["node_start"]), int(e["node_count"])
        c0, nc = int(e["call_start"]), int(e["call_count"])
        if n0 < 0 or c0 < 0 or n0 + nn > len(nt) or c0 + nc > len(ct):
            raise ShardError(path, "executions", f"row {ei}: node/call range outside the tables")
        rows = nt[n0:n0 + nn]
        if (rows["execution"] != ei).any() or (rows["node"] != np.arange(nn)).any():
            raise ShardError(path, "nodes", f"rows {n0}..{n0 + nn} are not execution {ei}'s "
                                            f"nodes 0..{nn - 1}")
        col = {k: rows[k].tolist() for k in rows.dtype.names}  # python lists: 10x faster than rows
        nodes = [Node(i, p, k.decode(), tokens[s:s + ln], ts, logprobs[ls:ls + ln - ts], mr.decode(),
                      ar.decode(), pv, ci)
                 for i, p, k, s, ln, ts, ls, mr, ar, pv, ci in zip(
                     col["node"], col["parent"], col["key"], col["token_start"], col["length"],
                     col["target_start"], col["logprob_start"], col["message_role"], col["agent_role"],
                     col["policy_version"], col["call_index"])]
        cc = {k: ct[k][c0:c0 + nc].tolist() for k in ct.dtype.names}
        for k, v in CALL_DEFAULTS_V1.items():
            cc.setdefault(k, [v] * nc)
        calls = [CallRecord(i, leaf, ar.decode(), ni, no, wv.decode(), pv, ep.decode(), fr.decode(), t0, t1,
                            tp, p, k, mp, dg)
                 for i, leaf, ar, ni, no, wv, pv, ep, fr, t0, t1, tp, p, k, mp, dg in zip(
                     cc["call"], cc["leaf"], cc["agent_role"], cc["n_input"], cc["n_output"],
                     cc["weight_version"], cc["policy_version"], cc["endpoint"], cc["finish_reason"],
                     cc["t_start"], cc["t_end"], cc["temperature"], cc["top_p"], cc["top_k"],
                     cc["min_p"], cc["output_digest"])]
        try:
            tree = TrajectoryTree.from_parts(nodes, calls)
        except ValueError as err:
            raise ShardError(path, "nodes", f"execution {ei}: {err}") from None
        tree.routing = routing.get(ei)
        out.append(ExecutionRecord(
            execution_id=_s(e["execution_id"]), task=_s(e["task"]), group=int(e["group"]),
            status=_s(e["status"]), reward=float(e["reward"]), reward_source=_s(e["reward_source"]),
            passed=int(e["passed"]), total=int(e["total"]), t_start=float(e["t_start"]),
            t_end=float(e["t_end"]), workspace=_s(e["workspace"]), tree=tree,
            error=_s(e["error"]) or None if "error" in e.dtype.names else None))
    return out


def _plain(v: object) -> object:
    if isinstance(v, (bytes, str)):
        return _s(v)
    return v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v


def read_attrs(path: str | os.PathLike, locking: bool = False) -> dict:
    """The file attributes of a shard (schema, identity, checksums, counts)."""
    path = Path(path)
    try:
        with h5py.File(path, "r", locking=locking) as f:
            return {k: _plain(v) for k, v in f.attrs.items()}
    except Exception as e:
        raise ShardError(path, "(file)", f"cannot open as HDF5 (truncated or not a shard?): {e}") from None


def read_shard(path: str | os.PathLike, verify: bool = True, locking: bool = False,
               expect_identity: dict | None = None) -> list[ExecutionRecord]:
    """All executions of one shard, trees rebuilt; raises ``ShardError`` on a bad shard.

    ``expect_identity`` (e.g. ``{"tokenizer": h}``) refuses shards recorded with another one.
    """
    path = Path(path)
    try:
        f = h5py.File(path, "r", locking=locking)
    except Exception as e:
        raise ShardError(path, "(file)", f"cannot open as HDF5 (truncated or not a shard?): {e}") from None
    with f:
        for k, v in (expect_identity or {}).items():
            got = _attr(path, f, f"identity_{k}")
            if got is None or _s(got) != str(v):
                raise ShardError(path, f"attribute identity_{k}", f"is {got and _s(got)!r}, expected {v!r}")
        data = _read_all(path, f, verify)
    try:
        return _records(path, data)
    except (ValueError, IndexError, TypeError, UnicodeDecodeError, OverflowError) as e:
        raise ShardError(path, "nodes/calls/executions", f"inconsistent tables: {e}") from None


COMPACT_SUFFIX = ".c.h5"  # a compacted shard: its ``compacted_from`` attribute names its sources


def compacted_sources(path: str | os.PathLike) -> list[str]:
    """File names (same directory) a compacted shard replaces; [] when it cannot be read (its
    sources are then still the truth)."""
    try:
        raw = read_attrs(path).get("compacted_from", "[]")
        return [str(n) for n in json.loads(raw)]
    except (ShardError, ValueError, TypeError):
        return []


def shard_paths(paths_or_dirs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Shard files named or found (``*.h5``, sorted) in directories; ``*.tmp`` never, nor a
    source of a compacted shard in the same directory (a compaction cut short by a crash)."""
    if isinstance(paths_or_dirs, (str, os.PathLike)):
        paths_or_dirs = [paths_or_dirs]
    out: list[Path] = []
    for p in map(Path, paths_or_dirs):
        if p.is_dir():
            found = sorted(q for q in p.glob("*.h5") if q.is_file())
            covered = {n for q in found if q.name.endswith(COMPACT_SUFFIX) for n in compacted_sources(q)}
            out += [q for q in found if q.name not in covered]
        elif not p.name.endswith(".tmp"):
            out.append(p)
    return out


def compact(writer: "ShardWriter", per_shard: int) -> list[Path]:
    """Merge the small shards of ``writer.dir`` (fewer than ``per_shard`` executions, not
    compacted already) into shards of up to ``per_shard``; returns the new shards.

    Each merged shard is written whole (temp + rename) naming its sources, then the sources are
    removed: a crash at any point leaves every execution readable exactly once (``shard_paths``).
    A source that cannot be read is left where it is, for ``gyre inspect`` to report."""
    d = Path(writer.dir)
    if not d.is_dir():
        return []
    found = sorted(q for q in d.glob("*.h5") if q.is_file())
    for q in found:  # finish a compaction a crash cut short
        if q.name.endswith(COMPACT_SUFFIX):
            for name in compacted_sources(q):
                (d / name).unlink(missing_ok=True)
    small: list[tuple[Path, list[ExecutionRecord]]] = []
    for q in found:
        if q.name.endswith(COMPACT_SUFFIX) or not q.exists():
            continue
        try:
            if int(read_attrs(q).get("n_executions", per_shard)) >= per_shard:
                continue
            small.append((q, read_shard(q, locking=writer.locking)))
        except ShardError as err:
            _log_error(err)
    out: list[Path] = []
    batch: list[tuple[Path, list[ExecutionRecord]]] = []
    for item in small + [None]:  # type: ignore[list-item]
        full = item is None or sum(len(r) for _, r in batch) + len(item[1]) > per_shard
        if full and len(batch) > 1:
            names = [q.name for q, _ in batch]
            out.append(writer.write([r for _, rs in batch for r in rs],
                                    {"compacted_from": json.dumps(names)}, COMPACT_SUFFIX))
            faults.hit("store", "compacted")  # merged shard written, sources not yet removed
            for q, _ in batch:
                q.unlink(missing_ok=True)
            fsync_path(d)
        if full:
            batch = []
        if item is not None:
            batch.append(item)
    return out


def _log_error(err: ShardError) -> None:
    log.error("skipping bad shard %s", err)


def iter_executions(paths_or_dirs: str | os.PathLike | Iterable[str | os.PathLike], verify: bool = True,
                    on_error: Callable[[ShardError], None] | None = None, locking: bool = False,
                    expect_identity: dict | None = None) -> Iterator[ExecutionRecord]:
    """Executions of every shard in order; a bad shard is reported to ``on_error`` (default:
    logged) and skipped whole, and reading goes on with the next one."""
    for path in shard_paths(paths_or_dirs):
        try:
            records = read_shard(path, verify, locking, expect_identity)
        except ShardError as err:
            (on_error or _log_error)(err)
            continue
        yield from records

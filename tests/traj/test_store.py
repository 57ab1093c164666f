"""HDF5 shards: round trip of every field, atomic private writes, and bad shards reported by
file and dataset while the good ones are still read."""

from __future__ import annotations

import math
import os
import re
import stat
import subprocess
import sys
import tracemalloc
from dataclasses import fields, replace
from pathlib import Path

import h5py
import numpy as np
import pytest

from gyre.cli import main as gyre_main
from gyre.config import StoreConfig
from gyre.traj.record import ExecutionRecord
from gyre.traj.store import (SCHEMA_VERSION, ShardError, ShardWriter, digest, iter_executions, pack, read_attrs,
                             read_shard, shard_paths)
from gyre.traj.tree import Segment, TrajectoryTree
from support.store_records import IDENTITY, records

ROOT_DIR = Path(__file__).resolve().parents[2]


def writer(tmp_path: Path, **kw) -> ShardWriter:
    return ShardWriter(tmp_path / "shards", identity=IDENTITY, **kw)


def assert_same(a: ExecutionRecord, b: ExecutionRecord) -> None:
    for f in fields(ExecutionRecord):
        if f.name == "tree":
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), f.name
    ta, tb = a.tree, b.tree
    assert ta.calls == tb.calls
    assert len(ta.nodes) == len(tb.nodes)
    for m, n in zip(ta.nodes, tb.nodes):
        for f in fields(m):
            x, y = getattr(m, f.name), getattr(n, f.name)
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y), (m.id, f.name)
            else:
                assert x == y, (m.id, f.name)
    assert ta.stats() == tb.stats() and ta.leaves() == tb.leaves()
    assert ta._children == tb._children
    for c in ta.calls:
        np.testing.assert_array_equal(ta.call_input_ids(c), tb.call_input_ids(c))
    assert (a.min_version, a.max_version) == (b.min_version, b.max_version)


@pytest.mark.parametrize("compression", ["none", "lzf", "gzip"])
def test_round_trip_every_field(tmp_path, compression):
    recs = records()
    path = writer(tmp_path, compression=compression, level=1, chunk_tokens=4096).write(recs)
    back = read_shard(path)
    assert len(back) == len(recs)
    for a, b in zip(recs, back):
        assert_same(a, b)
    attrs = read_attrs(path)
    assert attrs["schema_version"] == SCHEMA_VERSION and attrs["identity_model"] == "sha256:model0"
    assert attrs["n_executions"] == 4 and attrs["n_nodes"] == sum(len(r.tree.nodes) for r in recs)
    with h5py.File(path, "r", locking=False) as f:
        assert set(f.keys()) == {"tokens", "logprobs", "nodes", "calls", "executions"}
        assert all(isinstance(f[k], h5py.Dataset) for k in f)  # flat: no per-execution groups
        assert f["tokens"].dtype == np.int32 and f["logprobs"].dtype == np.float32
        assert f["tokens"].chunks is not None and f["nodes"].compression == "gzip"
        assert f["nodes"].dtype["agent_role"].kind == "S"  # fixed-width UTF-8 text


def test_a_shard_written_before_the_error_column_reads_as_no_error(tmp_path, monkeypatch):
    import gyre.traj.store as store
    old = tuple(c for c in store.EXECUTION_COLUMNS if c[0] != "error")
    monkeypatch.setattr(store, "EXECUTION_COLUMNS", old)
    monkeypatch.setitem(store.TABLES, "executions", old)
    path = writer(tmp_path).write(records(1))
    with h5py.File(path, "r", locking=False) as f:
        assert "error" not in f["executions"].dtype.names
    monkeypatch.undo()
    back = read_shard(path)
    assert [r.error for r in back] == [None, None]
    assert read_shard(writer(tmp_path / "new").write(records(1)))[0].error == "wall-clock limit of 600s reached"


def test_shards_are_private_uniquely_named_and_ordered(tmp_path):
    w = writer(tmp_path)
    paths = [w.write(records(1, seed=s)) for s in range(4)]
    assert len(set(paths)) == 4 and sorted(paths) == paths
    assert shard_paths(w.dir) == paths
    for p in paths:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
        assert re.fullmatch(r"shard-\d{8}T\d{12}Z-\d{6}-\d+\.h5", p.name)
    assert not list(w.dir.glob("*.tmp"))
    assert [r.execution_id for r in iter_executions(w.dir)] == good_ids(0, 1, 2, 3)


def test_identity_is_required():
    with pytest.raises(ValueError, match="tokenizer"):
        ShardWriter("/nonexistent", identity={"model": "m"})
    with pytest.raises(ValueError, match="compression"):
        ShardWriter("/nonexistent", compression="zstd", identity=IDENTITY)


def test_writer_from_config(tmp_path):
    cfg = StoreConfig()
    w = ShardWriter.from_config(cfg, tmp_path, IDENTITY)
    assert (w.compression, w.level, w.chunk_tokens, w.locking) == (
        cfg.compression, cfg.compression_level, cfg.chunk_tokens, cfg.hdf5_locking)
    assert read_shard(w.write(records(1)))[0].execution_id == "exec-0-0"


# -- bad shards ------------------------------------------------------------------------------
def three_shards(tmp_path: Path, **kw) -> tuple[ShardWriter, list[Path]]:
    w = writer(tmp_path, **kw)
    return w, [w.write(records(1, seed=s)) for s in range(3)]


def read_all(w: ShardWriter) -> tuple[list[str], list[ShardError]]:
    errors: list[ShardError] = []
    ids = [r.execution_id for r in iter_executions(w.dir, on_error=errors.append)]
    return ids, errors


def good_ids(*seeds: int) -> list[str]:
    return [i for s in seeds for i in (f"exec-{s}-0", "exec-empty")]


def test_truncated_shard_is_reported_and_others_read(tmp_path):
    w, paths = three_shards(tmp_path)
    size = paths[1].stat().st_size
    with open(paths[1], "r+b") as fh:
        fh.truncate(size // 2)
    ids, errors = read_all(w)
    assert ids == good_ids(0, 2)
    assert len(errors) == 1 and errors[0].path == str(paths[1])
    with pytest.raises(ShardError) as e:
        read_shard(paths[1])
    assert str(paths[1]) in str(e.value) and e.value.dataset


def flip(path: Path, dataset: str, offset_in_chunk: int = 100, n: int = 8) -> None:
    with h5py.File(path, "r", locking=False) as f:
        info = f[dataset].id.get_chunk_info(0)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + min(offset_in_chunk, info.size - n))
        data = fh.read(n)
        fh.seek(-n, 1)
        fh.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("dataset", ["tokens", "logprobs", "nodes", "calls"])
def test_checksum_mismatch_names_the_dataset(tmp_path, dataset):
    # uncompressed bulk arrays read back silently changed: only the checksum can tell
    w, paths = three_shards(tmp_path, compression="none")
    flip(paths[0], dataset)
    ids, errors = read_all(w)
    assert ids == good_ids(1, 2)
    (err,) = errors
    assert err.path == str(paths[0]) and err.dataset == dataset
    if dataset in ("tokens", "logprobs"):
        assert "checksum mismatch" in err.reason
    assert str(paths[0]) in str(err) and dataset in str(err)
    # without verification the flipped tokens come back unnoticed (so verify matters)
    if dataset == "tokens":
        assert len(read_shard(paths[0], verify=False)) == 2


def test_corrupted_compressed_chunk_names_the_dataset(tmp_path):
    w, paths = three_shards(tmp_path, compression="gzip")
    flip(paths[2], "tokens", offset_in_chunk=40, n=64)
    ids, errors = read_all(w)
    assert ids == good_ids(0, 1)
    assert [(e.path, e.dataset) for e in errors] == [(str(paths[2]), "tokens")]


def test_missing_dataset(tmp_path):
    w, paths = three_shards(tmp_path)
    with h5py.File(paths[1], "a", locking=False) as f:
        del f["calls"]
    ids, errors = read_all(w)
    assert ids == good_ids(0, 2)
    assert (errors[0].dataset, errors[0].reason) == ("calls", "missing dataset")


def test_missing_checksum_and_wrong_schema(tmp_path):
    w, paths = three_shards(tmp_path)
    with h5py.File(paths[0], "a", locking=False) as f:
        del f.attrs["sha256_nodes"]
    with h5py.File(paths[2], "a", locking=False) as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    ids, errors = read_all(w)
    assert ids == good_ids(1)
    assert [e.dataset for e in errors] == ["attribute sha256_nodes", "attribute schema_version"]
    assert "understands 1" in errors[1].reason


def test_not_an_hdf5_file_and_missing_file(tmp_path):
    w, paths = three_shards(tmp_path)
    paths[0].write_bytes(b"not hdf5 at all")
    errors: list[ShardError] = []
    ids = [r.execution_id for r in iter_executions([paths[0], tmp_path / "gone.h5", w.dir],
                                                   on_error=errors.append)]
    assert ids == good_ids(1, 2)
    assert [e.path for e in errors] == [str(paths[0]), str(tmp_path / "gone.h5"), str(paths[0])]


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_random_damage_is_caught_or_harmless(tmp_path, compression):
    # flip bytes anywhere (metadata, chunks, heaps): the reader returns exactly what was written
    # (damage in unused bytes) or raises ShardError; never another exception, never wrong data
    recs = records(2)
    path = writer(tmp_path, compression=compression).write(recs)
    blob = path.read_bytes()
    rng = np.random.default_rng(0)
    caught = 0
    for k in range(60):
        damaged = bytearray(blob)
        for pos in rng.integers(0, len(blob), 1 + k % 3):
            damaged[pos] ^= 1 << int(rng.integers(8))
        bad = tmp_path / f"bad-{k}.h5"
        bad.write_bytes(bytes(damaged))
        try:
            back = read_shard(bad)
        except ShardError as e:
            caught += 1
            assert e.path == str(bad) and e.dataset
            continue
        for a, b in zip(recs, back):
            assert_same(a, b)
    assert caught > 10


def test_expected_identity(tmp_path):
    _, paths = three_shards(tmp_path)
    assert read_shard(paths[0], expect_identity={"tokenizer": "sha256:tok0"})
    with pytest.raises(ShardError, match="identity_tokenizer"):
        read_shard(paths[0], expect_identity={"tokenizer": "sha256:other"})


def test_half_written_tmp_is_ignored(tmp_path):
    w, paths = three_shards(tmp_path)
    half = w.dir / (paths[0].name.replace("-000", "-999") + ".tmp")
    half.write_bytes(paths[0].read_bytes()[:5000])
    ids, errors = read_all(w)
    assert ids == good_ids(0, 1, 2) and errors == []
    assert half not in shard_paths([w.dir, half])


def test_default_error_report_logs_and_continues(tmp_path, caplog):
    w, paths = three_shards(tmp_path)
    paths[0].write_bytes(b"garbage")
    ids = [r.execution_id for r in iter_executions(w.dir)]
    assert ids == good_ids(1, 2)
    assert str(paths[0]) in caplog.text


# -- crashes while writing --------------------------------------------------------------------
def test_failed_rename_leaves_nothing(tmp_path, monkeypatch):
    w = writer(tmp_path)
    good = w.write(records(1))

    def boom(src, dst):
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="went away"):
        w.write(records(1, seed=5))
    assert sorted(w.dir.iterdir()) == [good]


def test_killed_writer_leaves_only_a_tmp(tmp_path):
    # the writer process dies (SIGKILL) at the rename: no shard under a final name
    d = tmp_path / "shards"
    script = f"""
import os, signal
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
from gyre.traj.store import ShardWriter
from gyre.traj.synthetic import Shape, generate
ShardWriter({str(d)!r}, identity={IDENTITY!r}).write([generate(Shape(calls=20))])
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT_DIR, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    left = list(d.iterdir())
    assert len(left) == 1 and left[0].name.endswith(".h5.tmp")
    errors: list[ShardError] = []
    assert list(iter_executions(d, on_error=errors.append)) == [] and errors == []


# -- inspect, documented checksum -------------------------------------------------
def test_inspect_prints_summary_and_tree(tmp_path, capsys):
    path = writer(tmp_path).write(records(2))
    assert gyre_main(["inspect", str(path), "--execution", "exec-0-1"]) == 0
    out = capsys.readouterr().out
    for text in ("gyre-trajectory-shard", "sha256:tok0", "exec-0-0", "exec-0-1", "subagent:explore",
                 "compactor", "target", "branch"):
        assert text in out, text
    assert gyre_main(["inspect", str(path), "--execution", "1", "--max-depth", "3", "--full"]) == 0
    out = capsys.readouterr().out
    assert "#2 " in out and "#5 " not in out.split("exec-0-1 (")[-1]
    assert gyre_main(["inspect", str(path), "--execution", "nope"]) == 1


def test_inspect_reads_directories_decodes_text_and_fits_80_columns(tmp_path, capsys, monkeypatch):
    from rich.console import Console

    from gyre.config import default_tiny_dir, load_config
    from gyre.model.tiny import ensure_tiny_model
    from gyre.traj import inspect as insp

    w = writer(tmp_path)
    w.write(records(1))
    w.write(records(2))
    monkeypatch.setattr(insp, "Console", lambda width=None: Console(width=80, color_system=None))
    assert gyre_main(["inspect", str(w.dir), "--execution", "exec-0-1"]) == 0  # a directory: every shard in it
    out = capsys.readouterr().out
    assert out.count("shard shard-") == 2 and max(len(x) for x in out.splitlines()) <= 80, out
    assert "a wider terminal shows" in out
    tiny = ensure_tiny_model(default_tiny_dir(load_config()))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    rec = read_shard(sorted(w.dir.glob("*.h5"))[0])[0]
    texts = [tok.decode([int(t) for t in n.tokens], skip_special_tokens=False) for n in rec.tree.nodes]
    words = {w for t in texts for w in re.findall(r"[A-Za-z]{4,}", t)}
    assert gyre_main(["inspect", str(w.dir), "--text", "--full", "--model", str(tiny)]) == 0
    out = capsys.readouterr().out
    assert words and sum(w in out for w in words) > 0.9 * len(words)  # the nodes' own tokens as text (80 columns wrap a few)
    assert gyre_main(["inspect", str(w.dir), "--full"]) == 0
    # and without --text, none: only the few that are also inspect's own labels (roles such as
    # "tool", "user"; "reward", "task", ...: ~12 of ~870 words)
    shown = [w for w in words if w in capsys.readouterr().out.split()]
    assert len(shown) <= 0.05 * len(words), shown


def test_inspect_tells_a_missing_file_from_a_bad_shard(tmp_path, capsys):
    assert gyre_main(["inspect", str(tmp_path / "nope.h5")]) == 2
    assert "no such file" in capsys.readouterr().out
    assert gyre_main(["inspect", str(tmp_path)]) == 2  # a directory without shards
    assert "no shard" in capsys.readouterr().out


def test_inspect_bad_shard_names_file_and_dataset(tmp_path, capsys):
    path = writer(tmp_path, compression="none").write(records(1))
    flip(path, "tokens")
    assert gyre_main(["inspect", str(path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert path.name in out and "dataset: tokens" in out and "checksum mismatch" in out


def test_schema_doc_checksum_recipe(tmp_path):
    path = writer(tmp_path).write(records(1))
    doc = (ROOT_DIR / "gyre/traj/schema.md").read_text()
    recipe = re.search(r"```python\n(import hashlib.*?)\nwith h5py", doc, re.S).group(1)
    ns: dict = {}
    exec(recipe, ns)
    with h5py.File(path, "r", locking=False) as f:
        for name in ("tokens", "logprobs", "nodes", "calls", "executions"):
            arr = f[name][()]
            assert ns["canonical_sha256"](arr) == digest(arr) == f.attrs[f"sha256_{name}"]


def test_empty_write_is_refused(tmp_path):
    with pytest.raises(ValueError):
        writer(tmp_path).write([])
    rec = replace(records(1)[-1], tree=TrajectoryTree())
    assert read_shard(writer(tmp_path).write([rec]))[0].tree.nodes == []


# -- per-execution shards and their compaction (invariant 7: durable before acknowledged) ----
def test_compaction_merges_small_shards_and_each_execution_reads_once(tmp_path):
    from gyre.traj.store import COMPACT_SUFFIX, compact

    w = writer(tmp_path)
    recs = records(5, seed=3)
    for r in recs:  # one shard per execution, as the drivers write them
        w.write([r])
    merged = compact(w, per_shard=3)
    assert len(merged) == 2 and all(p.name.endswith(COMPACT_SUFFIX) for p in merged)
    assert sorted(p.name for p in shard_paths(w.dir)) == sorted(p.name for p in merged)
    back = list(iter_executions(w.dir))
    assert [r.execution_id for r in back] == [r.execution_id for r in recs]
    for a, b in zip(recs, back):
        assert_same(a, b)
    assert compact(w, per_shard=3) == []  # nothing left to merge: idempotent


def test_a_compaction_cut_short_by_sigkill_shows_every_execution_once(tmp_path):
    """SIGKILL after the merged shard is written and before its sources are removed: readers see
    each execution once, and the next compaction removes the sources."""
    from gyre.traj.store import compact

    shards = tmp_path / "shards"
    script = ("import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])\n"
              "from support.store_records import records, IDENTITY\n"
              "from gyre.traj.store import ShardWriter, compact\n"
              "w = ShardWriter(sys.argv[3], identity=IDENTITY)\n"
              "[w.write([r]) for r in records(3, seed=5)]\n"
              "compact(w, per_shard=8)\n")
    env = {**os.environ, "GYRE_FAULT": "store:compacted", "GYRE_FAULT_DIR": str(tmp_path / "faults")}
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT_DIR), str(ROOT_DIR / "tests"), str(shards)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    on_disk = sorted(p.name for p in shards.glob("*.h5"))
    assert len(on_disk) == len(records(3, seed=5)) + 1  # the merged shard and its sources, all still there
    ids = [r.execution_id for r in iter_executions(shards)]
    assert sorted(ids) == sorted(r.execution_id for r in records(3, seed=5))  # each once
    compact(ShardWriter(shards, identity=IDENTITY), per_shard=8)
    assert len(list(shards.glob("*.h5"))) == 1
    assert sorted(r.execution_id for r in iter_executions(shards)) == sorted(ids)


def _long_execution(tokens: int) -> ExecutionRecord:
    """One execution whose tree holds ``tokens`` tokens in a few large nodes (xLong)."""
    tree, rng = TrajectoryTree(), np.random.default_rng(0)
    part = tokens // 4
    conv = [Segment(f"m{i}", rng.integers(0, 150_000, part, dtype=np.int32), "user") for i in range(3)]
    out = rng.integers(0, 150_000, part - 4, dtype=np.int32)
    tree.add_call(conv, "out", [1, 2, 3, 4], out, np.full(len(out), -0.5, np.float32), agent_role="main")
    return ExecutionRecord("xlong", "t", 0, status="done", tree=tree)


@pytest.mark.parametrize("chunk_tokens", [4093, 1 << 16])
def test_bulk_datasets_are_written_from_the_nodes_in_chunks(tmp_path, chunk_tokens):
    """Nodes straddling chunk boundaries come back intact, with the concatenation's checksum."""
    recs = records(2)
    path = writer(tmp_path, chunk_tokens=chunk_tokens).write(recs)
    for a, b in zip(recs, read_shard(path)):
        assert_same(a, b)
    with h5py.File(path, "r") as f:
        packed = pack(recs)
        assert f.attrs["sha256_tokens"] == digest(packed["tokens"])
        assert f["tokens"].chunks == (min(len(packed["tokens"]), chunk_tokens),)


def test_a_million_token_execution_is_written_without_a_copy_and_read_as_one(tmp_path):
    rec = _long_execution(1_000_000)
    w = writer(tmp_path)
    tracemalloc.start()
    try:
        path = w.write([rec])
        write_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        back = read_shard(path)[0]
        read_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    token_bytes = 4 * 1_000_000
    assert write_peak < token_bytes / 4  # a chunk buffer and the tables, no concatenated copy
    assert read_peak < 1.6 * (token_bytes + 4 * len(rec.tree.nodes[-1].logprobs))  # one copy, views per node
    assert [n.tokens.tolist() for n in back.tree.nodes] == [n.tokens.tolist() for n in rec.tree.nodes]

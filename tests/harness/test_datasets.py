"""Tasks as datasets (gyre/harness/datasets.py): JSONL, parquet and Hugging Face directories with one
schema; bad rows refused with their line; a seeded shuffle, weights and a validation split."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gyre.config import ConfigError, load_config
from gyre.harness.datasets import TaskStream, load_dataset
from gyre.harness.evaluator import EvalOptions, evaluate_workspace
from gyre.harness.execute import read_tasks
from gyre.harness.runner import prepare_workspace

ROOT = Path(__file__).resolve().parents[2]
TEST = "from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n\ndef test_neg():\n    assert add(-1, 1) == 0\n"


def good(name: str, **kw) -> dict:
    row = {"name": name, "prompt": f"Write calc.add ({name}).", "files": {"README.md": "calc\n"},
           "tests": {"tests/test_calc.py": TEST}, "test_commands": ["pytest -q tests"], "test_case_count": 2,
           "metadata": {"difficulty": 1}}
    row.update(kw)
    return row


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


BAD = [
    "{not json",                                                    # line 3
    {"name": "noprompt", "test_commands": ["pytest"], "test_case_count": 1},                   # 4
    good("a", colour="red"),                                        # 5: unknown field
    good("a"),                                                      # 6: name used by line 1
    good("esc", files={"../../etc/x": "y"}),                        # 7: path escapes
    {"name": "notests", "prompt": "p"},                             # 8: no tests, no reward
    good("badcount", test_case_count=0),                            # 9
    good("w", weight=-1),                                           # 10
]


def test_jsonl_rows_load_and_bad_rows_are_refused_with_their_line(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [good("a"), good("b", weight=3)] + BAD)
    ds = load_dataset(path, tmp_path / "out")
    assert [t.name for t in ds.train] == ["a", "b"] and ds.rows_loaded == 2 and ds.rows_refused == 8
    why = dict(ds.refused)
    assert sorted(why) == list(range(3, 11))
    assert "not valid JSON" in why[3] and "prompt" in why[4] and "colour" in why[5] and "earlier row" in why[6]
    assert "escapes" in why[7] and "no test_commands and no [reward]" in why[8] and "test_case_count" in why[9]
    assert "weight" in why[10]
    b = ds.train[1]
    assert b.weight == 3.0 and b.metadata == {"difficulty": 1} and b.test_files == ("tests/test_calc.py",)
    with pytest.raises(ConfigError, match="line 3: not valid JSON"):
        load_dataset(path, tmp_path / "strict", strict=True)
    # without tests a row is scored by the reward alone, when one is configured
    ok = load_dataset(write_jsonl(tmp_path / "r.jsonl", [{"name": "r", "prompt": "p"}]), tmp_path / "r",
                      reward_configured=True)
    assert ok.train[0].test_commands == () and ok.rows_refused == 0


@pytest.mark.slow
def test_a_row_is_a_task_the_harness_and_evaluator_use(tmp_path):
    ds = load_dataset(write_jsonl(tmp_path / "t.jsonl", [good("calc")]), tmp_path / "out")
    task = ds.train[0]
    ws, _ = prepare_workspace(tmp_path / "run", "calc-0", task)
    assert (ws / "README.md").read_text() == "calc\n" and (ws / "start.md").read_text() == task.prompt
    assert not (ws / "tests").exists()  # the hidden tests are never in the workspace
    opts = EvalOptions(timeout_s=60, scratch_dir=str(tmp_path / "scratch"))
    assert evaluate_workspace(task, ws, "done", opts).reward == 0.0
    (ws / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    ev = evaluate_workspace(task, ws, "done", opts)
    assert (ev.reward, ev.passed, ev.total) == (1.0, 2, 2), ev


@pytest.mark.slow
def test_parquet_and_hf_directory_read_the_same_schema(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [good("a"), good("b", split="validation")]
    flat = [{**r, "files": json.dumps(r["files"]),  # a JSON string and a list of {path, content}
             "tests": [{"path": k, "content": v} for k, v in r["tests"].items()],
             "metadata": json.dumps(r["metadata"])} for r in rows]
    flat[0]["split"] = None
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "t.parquet")
    ds = load_dataset(tmp_path / "t.parquet", tmp_path / "pq")
    assert [t.name for t in ds.train] == ["a"] and [t.name for t in ds.validation] == ["b"]
    assert ds.train[0].test_files == ("tests/test_calc.py",) and ds.train[0].metadata == {"difficulty": 1}
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(flat)}).save_to_disk(str(tmp_path / "hf"))
    hf = load_dataset(tmp_path / "hf", tmp_path / "hfo")
    assert [t.name for t in hf.train] == ["a"] and [t.name for t in hf.validation] == ["b"]
    with pytest.raises(ConfigError, match="hf_split: 'test' is not a split"):
        load_dataset(tmp_path / "hf", tmp_path / "x", hf_split="test")
    with pytest.raises(ConfigError, match="cannot tell the format"):
        load_dataset(write_jsonl(tmp_path / "t.txt", [good("a")]), tmp_path / "y")


def test_validation_split_is_seeded(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [good(f"t{i}") for i in range(10)])
    a = load_dataset(path, tmp_path / "a", validation_share=0.3, seed=1)
    b = load_dataset(path, tmp_path / "b", validation_share=0.3, seed=1)
    c = load_dataset(path, tmp_path / "c", validation_share=0.3, seed=2)
    names = lambda ds: sorted(t.name for t in ds.validation)  # noqa: E731
    assert len(a.validation) == 3 and len(a.train) == 7 and names(a) == names(b) and names(a) != names(c)
    cfg = load_config(None, [f"dataset.path={path}", "dataset.validation_share=0.3", "dataset.seed=1",
                             f"run.dir={tmp_path / 'run'}"])
    assert sorted(t.name for t in read_tasks(cfg).tasks) == sorted(t.name for t in a.train)


def test_task_stream_shuffles_by_seed_and_weights(tmp_path):
    ds = load_dataset(write_jsonl(tmp_path / "t.jsonl", [good(f"t{i}") for i in range(5)]), tmp_path / "o")
    first = [t.name for t, _ in zip(TaskStream(ds.train, shuffle=True, seed=3), range(10))]
    assert sorted(first[:5]) == sorted(first[5:]) == [f"t{i}" for i in range(5)]  # each pass a permutation
    assert first[:5] != [f"t{i}" for i in range(5)] or first[5:] != first[:5]
    assert [t.name for t, _ in zip(TaskStream(ds.train, shuffle=True, seed=3), range(10))] == first
    assert [t.name for t, _ in zip(TaskStream(ds.train, shuffle=True, seed=3, start=4), range(6))] == first[4:]
    assert [t.name for t, _ in zip(TaskStream(ds.train), range(6))] == ["t0", "t1", "t2", "t3", "t4", "t0"]
    weighted = load_dataset(write_jsonl(tmp_path / "w.jsonl", [good("rare"), good("often", weight=9)]),
                            tmp_path / "w")
    drawn = Counter(t.name for t, _ in zip(TaskStream(weighted.train, seed=0), range(1000)))
    assert 850 < drawn["often"] < 950, drawn


def test_gyre_tasks_shows_rows_and_refusals(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [good("a"), good("b", split="validation"), "{bad"])
    out = subprocess.run([sys.executable, "-m", "gyre.cli", "tasks", str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2 rows loaded (1 train, 1 validation), 1 refused" in out.stdout, out.stdout
    lines = out.stdout.splitlines()
    assert any(x.startswith("a\t") and x.endswith("train\t1") for x in lines), out.stdout
    assert any(x.startswith("line 3\t") and "not valid JSON" in x for x in lines), out.stdout

"""Tasks as rows of a dataset: a JSONL file, a parquet file, or a local Hugging Face `datasets`
directory (``save_to_disk``), configured by ``[dataset]``.

One row is one task. Its fields (JSON types; parquet/HF columns of the same names):

    name            str, optional    the task's name ([A-Za-z0-9._-], unique); default ``row<N>``
    prompt          str, required    the requirements document (the harness's start.md)
    files           {path: text}     laid into the workspace before the harness starts
    tests           {path: text}     hidden tests, added to the scored copy (never shown to the harness)
    test_commands   [str]            run in the scored copy, NL2RepoBench's way (gyre.harness.scoring)
    test_case_count int > 0          how many test cases a perfect answer passes (with test_commands)
    weight          number > 0       relative chance of being drawn for training (default 1)
    split           "train" | "validation"   held out for validation when "validation"
    metadata        object           handed to a reward function as task["metadata"]

A row needs ``test_commands`` (and ``test_case_count``) or a configured reward (``[reward]``):
without tests it is scored by the reward alone. ``files``/``tests`` may also be given as a list of
``{"path", "content"}`` objects or a JSON string (parquet writers often flatten maps that way).

A bad row is refused with its line (JSONL) or row number and why, logged and counted; the rest
load (``harness.strict_suite`` refuses the dataset instead). Each row is written out as a task
folder in the NL2RepoBench layout under ``<run.dir>/dataset/``, so the harness, the sandboxes and
the evaluator treat it exactly like a suite's task.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from gyre.config import ConfigError
from gyre.harness.tasks import Suite, SuiteError, Task, safe_relpath

log = logging.getLogger(__name__)

FIELDS = ("name", "prompt", "files", "tests", "test_commands", "test_case_count", "weight", "split", "metadata")
SPLITS = ("train", "validation")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RowError(ValueError):
    """One row is malformed; the message names the field."""


@dataclass
class Dataset:
    path: Path
    train: list[Task]
    validation: list[Task]
    refused: list[tuple[int, str]] = field(default_factory=list)  # (line or row number, why)

    @property
    def rows_loaded(self) -> int:
        return len(self.train) + len(self.validation)

    @property
    def rows_refused(self) -> int:
        return len(self.refused)

    def suite(self, split: str = "train") -> Suite:
        """As a Suite (what `gyre tasks`, `gyre rollout` and the head read): the refused rows are its
        skipped entries, named by line."""
        tasks = self.train if split == "train" else self.validation
        return Suite(self.path, list(tasks), [(f"line {n}", why) for n, why in self.refused])


def read_rows(path: Path, fmt: str = "auto", hf_split: str = "train") -> Iterator[tuple[int, object]]:
    """(line or row number from 1, the row as read) of a JSONL, parquet or HF dataset directory.
    A JSONL line that is not JSON is yielded as a RowError for its number."""
    kind = fmt if fmt != "auto" else ("hf" if path.is_dir() else "parquet" if path.suffix == ".parquet"
                                      else "jsonl" if path.suffix in (".jsonl", ".json", ".ndjson") else "")
    if not path.exists():
        raise ConfigError(f"dataset.path: {path} does not exist")
    if kind == "jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    yield n, RowError(f"not valid JSON: {e}")
    elif kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"dataset.path: {path} is parquet, which needs pyarrow: pip install pyarrow "
                              "(or pip install 'gyre[datasets]')") from None
        for n, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield n, row
    elif kind == "hf":
        try:
            import datasets
        except ImportError:
            raise ConfigError(f"dataset.path: {path} is a Hugging Face dataset directory, which needs the "
                              "`datasets` package: pip install datasets (or pip install 'gyre[datasets]')") from None
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if hf_split not in ds:
                raise ConfigError(f"dataset.hf_split: {hf_split!r} is not a split of {path}; it has "
                                  f"{', '.join(ds)}")
            ds = ds[hf_split]
        for n, row in enumerate(ds, 1):
            yield n, row
    else:
        raise ConfigError(f"dataset.path: cannot tell the format of {path} (.jsonl, .parquet or a Hugging Face "
                          "dataset directory); set dataset.format")


def _files(value, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"{what}: a string here must be a JSON object of path -> text ({e})") from None
    if isinstance(value, list):  # [{"path", "content"}] or [[path, text]] (parquet maps)
        try:
            value = {(v["path"] if isinstance(v, dict) else v[0]): (v["content"] if isinstance(v, dict) else v[1])
                     for v in value}
        except (KeyError, IndexError, TypeError):
            raise RowError(f"{what}: a list here must hold {{\"path\", \"content\"}} objects") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise RowError(f"{what}: expected an object of path -> text")
    out = {}
    for rel, text in value.items():
        try:
            out[safe_relpath("<row>", what, rel)] = text
        except SuiteError:
            raise RowError(f"{what}: path {rel!r} escapes the workspace") from None
    return out


def parse_row(n: int, row, *, reward_configured: bool) -> dict:
    """The row's fields, checked; RowError naming the first bad one."""
    if isinstance(row, RowError):
        raise row
    if not isinstance(row, dict):
        raise RowError(f"expected an object, got {type(row).__name__}")
    unknown = sorted(k for k in row if k not in FIELDS and row[k] is not None)
    if unknown:
        raise RowError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    name = row.get("name") or f"row{n}"
    if not isinstance(name, str) or not _NAME.match(name):
        raise RowError(f"name {name!r}: letters, digits, '.', '_' and '-' only (a folder name)")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RowError("prompt: required, a non-empty string")
    commands = row.get("test_commands") or []
    if isinstance(commands, str):
        commands = [commands]
    if not isinstance(commands, list) or not all(isinstance(c, str) and c.strip() for c in commands):
        raise RowError("test_commands: expected a list of non-empty strings")
    count = row.get("test_case_count")
    if commands and (isinstance(count, bool) or not isinstance(count, int) or count <= 0):
        raise RowError(f"test_case_count: a positive integer is required with test_commands, got {count!r}")
    if not commands and not reward_configured:
        raise RowError("no test_commands and no [reward] configured: nothing could score this row")
    weight = row.get("weight", 1.0)
    weight = 1.0 if weight is None else weight
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise RowError(f"weight: expected a positive number, got {weight!r}")
    split = row.get("split") or None
    if split is not None and split not in SPLITS:
        raise RowError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
    meta = row.get("metadata") or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            meta = None
    if not isinstance(meta, dict):
        raise RowError("metadata: expected an object")
    return {"name": name, "prompt": prompt, "files": _files(row.get("files"), "files"),
            "tests": _files(row.get("tests"), "tests"), "test_commands": [str(c) for c in commands],
            "test_case_count": int(count) if commands else 0, "weight": float(weight), "split": split,
            "metadata": meta}


def materialize(row: dict, root: Path) -> Task:
    """The row as a task folder (NL2RepoBench layout, plus `workspace/` and `hidden/`) under root."""
    d = root / row["name"]
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    (d / "start.md").write_text(row["prompt"], encoding="utf-8")
    (d / "test_commands.json").write_text(json.dumps(row["test_commands"]), encoding="utf-8")
    (d / "test_case_count.txt").write_text(str(row["test_case_count"]), encoding="utf-8")
    (d / "test_files.json").write_text(json.dumps(sorted(row["tests"])), encoding="utf-8")
    for sub, files in (("hidden", row["tests"]), ("workspace", row["files"])):
        for rel, text in files.items():
            p = d / sub / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text, encoding="utf-8")
    (d / "hidden").mkdir(exist_ok=True)  # the tests root (empty for a reward-only row)
    return Task(name=row["name"], dir=d, prompt=row["prompt"], test_commands=tuple(row["test_commands"]),
                test_case_count=row["test_case_count"], test_files=tuple(sorted(row["tests"])), tests_dir=d / "hidden",
                image=None, workspace_dir=d / "workspace" if row["files"] else None, weight=row["weight"],
                metadata=row["metadata"])


def load_dataset(path: str | Path, root: str | Path, *, fmt: str = "auto", hf_split: str = "train",
                 validation_share: float = 0.0, seed: int = 0, reward_configured: bool = False,
                 strict: bool = False) -> Dataset:
    """Read, check and lay out every row under ``root``; split off the validation rows (those marked
    ``validation`` and, of the others, ``validation_share`` chosen with ``seed``)."""
    path = Path(path).expanduser()
    root = Path(root)
    rows, refused, names = [], [], set()
    for n, raw in read_rows(path, str(fmt), hf_split):
        try:
            row = parse_row(n, raw, reward_configured=reward_configured)
            if row["name"] in names:
                raise RowError(f"name {row['name']!r} is used by an earlier row")
        except RowError as e:
            where = "line" if path.is_file() and path.suffix != ".parquet" else "row"
            if strict:
                raise ConfigError(f"dataset {path}: {where} {n}: {e} (strict reading: harness.strict_suite)") from None
            log.warning("dataset %s: %s %d refused: %s", path, where, n, e)
            refused.append((n, str(e)))
            continue
        names.add(row["name"])
        rows.append(row)
    if not rows:
        why = f"; e.g. line {refused[0][0]}: {refused[0][1]}" if refused else ""
        raise ConfigError(f"dataset {path}: no usable row ({len(refused)} refused{why})")
    unmarked = [r for r in rows if r["split"] is None]
    held = set(r["name"] for r in rows if r["split"] == "validation")
    if validation_share > 0 and unmarked:
        k = max(1, round(validation_share * len(unmarked)))
        held |= {r["name"] for r in random.Random(seed).sample(unmarked, min(k, len(unmarked) - 1 or 1))}
    root.mkdir(parents=True, exist_ok=True)
    train, val = [], []
    for r in rows:
        (val if r["name"] in held else train).append(materialize(r, root))
    if not train:
        raise ConfigError(f"dataset {path}: every row is held out for validation; lower dataset.validation_share")
    if refused:
        log.warning("dataset %s: %d rows loaded, %d refused", path, len(rows), len(refused))
    return Dataset(path, train, val, refused)


def dataset_from_config(cfg, root: str | Path | None = None) -> Dataset:
    d = cfg.dataset
    return load_dataset(d.path, root or Path(cfg.run.dir) / "dataset", fmt=d.format, hf_split=d.hf_split,
                        validation_share=d.validation_share, seed=d.seed,
                        reward_configured=bool(cfg.reward.function or cfg.reward.url), strict=cfg.harness.strict_suite)


class TaskStream:
    """The order in which groups get their tasks: the suite's order, cycled (the default), a
    seeded shuffle per pass, or, where weights differ, a seeded weighted draw. ``start`` skips the
    draws already made (a resumed run continues the same sequence)."""

    def __init__(self, tasks: list, *, shuffle: bool = False, seed: int = 0, start: int = 0):
        if not tasks:
            raise ConfigError("no task to draw from")
        self.tasks, self.shuffle = list(tasks), shuffle
        self.weights = [float(getattr(t, "weight", 1.0)) for t in self.tasks]
        self.weighted = len(set(self.weights)) > 1
        self.rng = random.Random(seed)
        self._order: list = []
        for _ in range(start):
            next(self)

    def __iter__(self):
        return self

    def __next__(self):
        if self.weighted:
            return self.rng.choices(self.tasks, weights=self.weights)[0]
        if not self._order:
            self._order = list(self.tasks)
            if self.shuffle:
                self.rng.shuffle(self._order)
            self._order.reverse()  # popped from the end
        return self._order.pop()

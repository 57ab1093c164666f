"""Task suites in the NL2RepoBench layout.

One folder per task, holding the files NL2RepoBench publishes:

    start.md              the requirements document (the agent's task)
    test_commands.json    shell commands run in the candidate repository, e.g. ["pytest tests"]
    test_case_count.txt   how many test cases a perfect repository passes
    test_files.json       test paths (relative to the repository root) deleted from the candidate
                          before the reference tests are added

Shipped tests. Where a suite ships its tests, each path of ``test_files.json`` exists under the
task's *tests root* (the task folder itself unless ``gyre-task.json`` says ``"tests_root": "DIR"``),
laid out as in the repository: ``["tests"]`` means ``<task>/tests/`` is copied to ``<repo>/tests/``.

Image-only tasks. NL2RepoBench itself does not ship its tests: they live in one container image per
task. Such a suite names the image in ``gyre-suite.json`` at the suite root (``{task}`` is replaced
by the task name) or in a task's ``gyre-task.json``::

    {"image": "ghcr.io/multimodal-art-projection/nl2repobench/{task}:1.0"}

Those tasks load, run, and are reported as "cannot be scored locally: needs image X" (never 0).
A task with neither shipped tests nor an image is a suite error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
LEARNABLE_DIR = Path(__file__).resolve().parent / "builtin_learnable"  # the tiny model can learn these
SUITE_ALIASES = {"builtin": BUILTIN_DIR, "learnable": LEARNABLE_DIR}
SUITE_META = "gyre-suite.json"
TASK_META = "gyre-task.json"
REQUIRED = ("start.md", "test_commands.json", "test_case_count.txt", "test_files.json")
_MAX_FILE_BYTES = 4 << 20  # a requirements document is text; anything bigger is a broken suite


class SuiteError(ValueError):
    """A task suite is malformed; the message names the task and the file."""


@dataclass(frozen=True)
class Task:
    name: str
    dir: Path
    prompt: str
    test_commands: tuple[str, ...]
    test_case_count: int
    test_files: tuple[str, ...]
    tests_dir: Path | None  # root under which the test_files paths are shipped; None = not shipped
    image: str | None  # container image holding the tests, where the suite names one

    @property
    def scorable(self) -> bool:
        return self.tests_dir is not None

    @property
    def prompt_file(self) -> Path:
        return self.dir / "start.md"

    def unscorable_reason(self) -> str | None:
        if self.scorable:
            return None
        return f"cannot be scored locally: needs image {self.image}"


def _err(task: str, file: str, what: str) -> SuiteError:
    return SuiteError(f"task {task!r}: {file}: {what}")


def _read_text(task: str, path: Path, root: Path) -> str:
    name = path.name
    if not path.is_file():
        raise _err(task, name, "missing" if not path.exists() else "not a regular file")
    if not path.resolve().is_relative_to(root):
        raise _err(task, name, "is a link leading outside the task folder")
    if path.stat().st_size > _MAX_FILE_BYTES:
        raise _err(task, name, f"larger than {_MAX_FILE_BYTES} bytes")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _err(task, name, f"not UTF-8 text ({e})") from None


def _read_json(task: str, path: Path, root: Path):
    text = _read_text(task, path, root)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _err(task, path.name, f"not valid JSON: {e}") from None


def _string_list(task: str, file: str, value, *, allow_empty: bool) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise _err(task, file, f"expected a JSON list of non-empty strings, got {value!r:.200}")
    if not value and not allow_empty:
        raise _err(task, file, "the list is empty")
    return tuple(value)


def safe_relpath(task: str, file: str, rel: str) -> str:
    """A repository-relative path that cannot leave the directory it is joined to."""
    p = PurePosixPath(rel.strip())
    if p.is_absolute() or "\\" in rel or ".." in p.parts or not p.parts or str(p) == ".":
        raise _err(task, file, f"path {rel!r} escapes the task/repository folder")
    return str(p)


def _meta(task: str, path: Path, root: Path) -> dict:
    if not path.exists():
        return {}
    data = _read_json(task, path, root)
    if not isinstance(data, dict):
        raise _err(task, path.name, "expected a JSON object")
    unknown = set(data) - {"image", "tests_root"}
    if unknown:
        raise _err(task, path.name, f"unknown keys {sorted(unknown)}; known: image, tests_root")
    for key, v in data.items():
        if not isinstance(v, str) or not v.strip():
            raise _err(task, path.name, f"{key} must be a non-empty string")
    return data


def load_task(task_dir: str | Path, suite_meta: dict | None = None) -> Task:
    name = Path(task_dir).name  # the suite's folder name, even where the folder is a link
    d = Path(task_dir).resolve()
    if not d.is_dir():
        raise _err(name, str(d), "task folder does not exist")
    for f in REQUIRED:
        if not (d / f).exists():
            raise _err(name, f, "missing")
    prompt = _read_text(name, d / "start.md", d)
    commands = _string_list(name, "test_commands.json", _read_json(name, d / "test_commands.json", d),
                            allow_empty=False)
    count_text = _read_text(name, d / "test_case_count.txt", d).strip()
    try:
        count = int(count_text)
    except ValueError:
        raise _err(name, "test_case_count.txt", f"not a number: {count_text[:50]!r}") from None
    if count <= 0:
        raise _err(name, "test_case_count.txt", f"must be a positive number, got {count}")
    test_files = tuple(safe_relpath(name, "test_files.json", p) for p in _string_list(
        name, "test_files.json", _read_json(name, d / "test_files.json", d), allow_empty=True))

    meta = dict(suite_meta or {})
    meta.pop("tests_root", None)  # a suite-wide tests root would be ambiguous; it is per task
    meta.update(_meta(name, d / TASK_META, d))
    image = meta["image"].replace("{task}", name) if "image" in meta else None
    tests_root = d / safe_relpath(name, TASK_META, meta["tests_root"]) if "tests_root" in meta else d
    if not tests_root.resolve().is_relative_to(d):
        raise _err(name, TASK_META, "tests_root leads outside the task folder")

    shipped = [p for p in test_files if (tests_root / p).exists()]
    for p in shipped:
        if not (tests_root / p).resolve().is_relative_to(d):
            raise _err(name, "test_files.json", f"shipped test path {p!r} is a link leading outside the task")
    if shipped and len(shipped) < len(test_files):
        missing = [p for p in test_files if p not in shipped]
        raise _err(name, "test_files.json", f"tests are shipped but {missing} are missing under {tests_root}")
    tests_dir = tests_root if test_files and shipped else None
    if tests_dir is None and image is None:
        why = "lists no test paths" if not test_files else f"paths {list(test_files)} are not shipped"
        raise _err(name, "test_files.json", f"{why} and no image is named; add {SUITE_META} "
                   f"(or {TASK_META}) with {{\"image\": \"...\"}} to evaluate in a container")
    return Task(name=name, dir=d, prompt=prompt, test_commands=commands, test_case_count=count,
                test_files=test_files, tests_dir=tests_dir, image=image)


def resolve_suite(spec: str | Path) -> Path:
    """A suite name (``builtin``, ``learnable``) or a directory."""
    alias = SUITE_ALIASES.get(str(spec))
    return alias if alias is not None else Path(spec).expanduser().resolve()


def load_suite(spec: str | Path = "builtin", *, strict: bool = True) -> list[Task]:
    """All tasks of a suite, sorted by name. ``strict=False`` skips (and logs) broken tasks,
    e.g. the two NL2RepoBench tasks whose start.md failed to download."""
    root = resolve_suite(spec)
    if not root.is_dir():
        raise SuiteError(f"suite {spec!s}: {root} is not a directory")
    suite_meta = _meta(f"<suite {root.name}>", root / SUITE_META, root) if (root / SUITE_META).exists() else {}
    tasks = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        try:
            tasks.append(load_task(d, suite_meta))
        except SuiteError as e:
            if strict:
                raise
            log.warning("skipping a broken task: %s", e)
    if not tasks:
        raise SuiteError(f"suite {spec!s}: no task folders under {root}")
    return tasks

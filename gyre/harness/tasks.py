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
task, named ``ghcr.io/multimodal-art-projection/nl2repobench/<task>:1.0``. A task without shipped
tests takes its image from (first found) its ``gyre-task.json``, the suite's ``gyre-suite.json``
(``{task}`` is replaced by the task name), or the configured template (``harness.image_template``,
the benchmark's naming by default)::

    {"image": "ghcr.io/multimodal-art-projection/nl2repobench/{task}:1.0"}

Whether such a task can be scored here depends on whether its image is found locally
(gyre.harness.sandbox); if not it is reported unscorable (never 0 in Gyre's means; 0 in the
official score).

The repository as published (``test_files/<task>/``, or its root holding ``test_files/``) is read
unchanged: broken task folders (two ship ``start.md.download_failed.txt`` instead of ``start.md``)
are skipped with a warning and counted; ``strict=True`` refuses the suite instead. Links in a task
folder that lead outside it are refused: nothing outside a task is ever read or copied as its tests.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gyre.config import ConfigError

log = logging.getLogger(__name__)

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
LEARNABLE_DIR = Path(__file__).resolve().parent / "builtin_learnable"  # the tiny model can learn these
SUITE_ALIASES = {"builtin": BUILTIN_DIR, "learnable": LEARNABLE_DIR}
SUITE_META = "gyre-suite.json"
TASK_META = "gyre-task.json"
DEFAULT_IMAGE_TEMPLATE = "ghcr.io/multimodal-art-projection/nl2repobench/{task}:1.0"
def official_count_file(d: Path) -> str:
    """The file NL2RepoBench's test_data_service reads the test count from: the first ``*.txt``
    that ``os.listdir`` gives for the task folder (test_case_count.txt when it is the only one)."""
    txts = [f for f in os.listdir(d) if f.endswith(".txt")]
    return txts[0] if txts else "test_case_count.txt"


REQUIRED = ("start.md", "test_commands.json", "test_case_count.txt", "test_files.json")
_MAX_FILE_BYTES = 4 << 20  # a requirements document is text; anything bigger is a broken suite


class SuiteError(ConfigError):
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
    # a dataset row's (gyre.harness.datasets): files laid into the workspace, its draw weight, its metadata
    workspace_dir: Path | None = None
    weight: float = 1.0
    metadata: dict = field(default_factory=dict, compare=False, hash=False)

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


def _check_links(task: str, root: Path, d: Path) -> None:
    """Every link under a shipped test path must stay inside the task folder: copying the tests
    must never bring an outside file (another task's tests, a key) into the scored repository."""
    if root.is_symlink() and not _inside(root, d):
        raise _err(task, "test_files.json", f"{root.name} is a link leading outside the task")
    if not root.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink() and not _inside(p, d):
                raise _err(task, "test_files.json", f"{p.relative_to(d)} is a link leading outside the task")


def _inside(p: Path, root: Path) -> bool:
    try:
        return p.resolve().is_relative_to(root)
    except (OSError, RuntimeError):  # a link loop
        return False


def load_task(task_dir: str | Path, suite_meta: dict | None = None,
              image_template: str | None = DEFAULT_IMAGE_TEMPLATE) -> Task:
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
    count_file = official_count_file(d)
    count_text = _read_text(name, d / count_file, d).strip()
    try:
        count = int(count_text)
    except ValueError:
        why = "" if count_file == "test_case_count.txt" else \
            " (NL2RepoBench reads the count from the first *.txt of the task folder, this one)"
        raise _err(name, count_file, f"not a number: {count_text[:50]!r}{why}") from None
    if count <= 0:
        raise _err(name, count_file, f"must be a positive number, got {count}")
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
        if not _inside(tests_root / p, d):
            raise _err(name, "test_files.json", f"shipped test path {p!r} is a link leading outside the task")
        _check_links(name, tests_root / p, d)
    if shipped and len(shipped) < len(test_files):
        missing = [p for p in test_files if p not in shipped]
        raise _err(name, "test_files.json", f"tests are shipped but {missing} are missing under {tests_root}")
    tests_dir = tests_root if test_files and shipped else None
    if tests_dir is None and image is None and image_template:
        image = image_template.replace("{task}", name)
    if tests_dir is None and image is None:
        why = "lists no test paths" if not test_files else f"paths {list(test_files)} are not shipped"
        raise _err(name, "test_files.json", f"{why} and no image is named; add {SUITE_META} "
                   f"(or {TASK_META}) with {{\"image\": \"...\"}} to evaluate in a container")
    return Task(name=name, dir=d, prompt=prompt, test_commands=commands, test_case_count=count,
                test_files=test_files, tests_dir=tests_dir, image=image)


def resolve_suite(spec: str | Path) -> Path:
    """A suite name (``builtin``, ``learnable``) or a directory; the NL2RepoBench repository's
    root stands for its ``test_files/``."""
    alias = SUITE_ALIASES.get(str(spec))
    if alias is not None:
        return alias
    root = Path(spec).expanduser().resolve()
    if (root / "test_files").is_dir() and not any((p / "start.md").exists() for p in _task_dirs(root)):
        return root / "test_files"
    return root


def _task_dirs(root: Path) -> list[Path]:
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    except OSError:
        return []


@dataclass
class Suite:
    root: Path
    tasks: list[Task]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (task folder, why)


def read_suite(spec: str | Path = "builtin", *, strict: bool = False,
               image_template: str | None = DEFAULT_IMAGE_TEMPLATE) -> Suite:
    """All tasks of a suite, sorted by name, and the broken folders skipped (each logged).
    ``strict=True`` raises on the first broken folder instead."""
    root = resolve_suite(spec)
    if not root.is_dir():
        raise SuiteError(f"suite {spec!s}: {root} is not a directory (give 'builtin', 'learnable' or a "
                         f"folder of tasks in the NL2RepoBench layout)")
    suite_meta = _meta(f"<suite {root.name}>", root / SUITE_META, root) if (root / SUITE_META).exists() else {}
    suite = Suite(root, [])
    for d in _task_dirs(root):
        try:
            suite.tasks.append(load_task(d, suite_meta, image_template))
        except SuiteError as e:
            if strict:
                raise SuiteError(f"{e} (strict suite reading; drop --strict / harness.strict_suite "
                                 f"to skip broken tasks)") from None
            log.warning("skipping a broken task: %s", e)
            suite.skipped.append((d.name, str(e)))
    if not suite.tasks:
        why = f"; {len(suite.skipped)} broken, e.g. {suite.skipped[0][1]}" if suite.skipped else ""
        raise SuiteError(f"suite {spec!s}: no loadable task folders under {root}{why}")
    if suite.skipped:
        log.warning("suite %s: %d task folders skipped, %d loaded", root, len(suite.skipped), len(suite.tasks))
    return suite


def load_suite(spec: str | Path = "builtin", *, strict: bool = False,
               image_template: str | None = DEFAULT_IMAGE_TEMPLATE) -> list[Task]:
    """The tasks of :func:`read_suite`."""
    return read_suite(spec, strict=strict, image_template=image_template).tasks

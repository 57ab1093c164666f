"""Task suites: the builtin suite, the NL2RepoBench layout, and every kind of broken suite."""

import json
import os
from pathlib import Path

import pytest

from gyre.harness.tasks import read_suite, BUILTIN_DIR, SuiteError, load_suite, load_task

SOLUTIONS = Path(BUILTIN_DIR).parent / "builtin_solutions"


def make_task(root: Path, name="t1", *, commands='["pytest -q tests"]', count="3", files='["tests"]',
              start="# Do it\n", tests=True):
    d = root / name
    d.mkdir(parents=True)
    for fname, text in (("start.md", start), ("test_commands.json", commands),
                        ("test_case_count.txt", count), ("test_files.json", files)):
        if text is not None:
            (d / fname).write_text(text)
    if tests:
        (d / "tests").mkdir()
        (d / "tests" / "test_x.py").write_text("def test_a():\n    pass\n")
    return d


def test_builtin_suite():
    tasks = load_suite("builtin")
    assert len(tasks) >= 8
    assert [t.name for t in tasks] == sorted(t.name for t in tasks)
    for t in tasks:
        assert t.scorable and t.image is None and t.tests_dir == t.dir
        assert t.prompt.strip() and t.test_case_count > 0 and t.test_files == ("tests",)
        assert (t.dir / "tests").is_dir()
        assert (SOLUTIONS / t.name).is_dir(), f"{t.name} has no reference solution"
        assert not (t.dir / "tests" / "__init__.py").exists()


def test_suite_by_path(tmp_path):
    make_task(tmp_path, "b")
    make_task(tmp_path, "a")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "README.md").write_text("not a task")
    tasks = load_suite(str(tmp_path))
    assert [t.name for t in tasks] == ["a", "b"]
    t = tasks[0]
    assert t.test_commands == ("pytest -q tests",) and t.test_case_count == 3
    assert t.test_files == ("tests",) and t.tests_dir == (tmp_path / "a").resolve()


@pytest.mark.parametrize("kwargs,file,fragment", [
    (dict(start=None), "start.md", "missing"),
    (dict(commands=None), "test_commands.json", "missing"),
    (dict(count=None), "test_case_count.txt", "missing"),
    (dict(files=None), "test_files.json", "missing"),
    (dict(commands="[\"pytest\""), "test_commands.json", "not valid JSON"),
    (dict(commands='"pytest tests"'), "test_commands.json", "list"),
    (dict(commands="[]"), "test_commands.json", "empty"),
    (dict(commands='["pytest", 3]'), "test_commands.json", "list"),
    (dict(count="many"), "test_case_count.txt", "not a number"),
    (dict(count="0"), "test_case_count.txt", "positive"),
    (dict(files="{tests}"), "test_files.json", "not valid JSON"),
    (dict(files='["../outside"]'), "test_files.json", "escapes"),
    (dict(files='["/etc/passwd"]'), "test_files.json", "escapes"),
    (dict(files='["tests/../../x"]'), "test_files.json", "escapes"),
    (dict(files='["tests", "more_tests"]'), "test_files.json", "missing"),
    (dict(files='["tests"]', tests=False), "test_files.json", "no image"),
    (dict(files="[]"), "test_files.json", "no test paths"),
    (dict(start="\udcff"), "start.md", None),
])
def test_bad_suites_name_task_and_file(tmp_path, kwargs, file, fragment):
    if kwargs.get("start") == "\udcff":
        d = make_task(tmp_path, "broken", start="x")
        (d / "start.md").write_bytes(b"\xff\xfe bad")
        fragment = "UTF-8"
    else:
        make_task(tmp_path, "broken", **kwargs)
    with pytest.raises(SuiteError) as info:
        load_suite(tmp_path, strict=True, image_template=None)
    msg = str(info.value)
    assert "'broken'" in msg and file in msg and fragment in msg, msg


def test_link_leading_outside(tmp_path):
    secret = tmp_path / "secret.md"
    secret.write_text("outside")
    d = make_task(tmp_path / "suite", "linked")
    (d / "start.md").unlink()
    os.symlink(secret, d / "start.md")
    with pytest.raises(SuiteError, match="'linked'.*start.md.*outside"):
        load_suite(tmp_path / "suite")


def test_image_only_suite(tmp_path):
    # The published NL2RepoBench layout: no tests, one image per task named by the suite.
    make_task(tmp_path, "six", commands='["pip install -e .", "pytest test_six.py"]', count="199",
              files='["test_six.py"]', tests=False)
    make_task(tmp_path, "own", files='["test_own.py"]', tests=False)
    (tmp_path / "own" / "gyre-task.json").write_text('{"image": "registry.example/own:2"}')
    (tmp_path / "gyre-suite.json").write_text(json.dumps(
        {"image": "ghcr.io/multimodal-art-projection/nl2repobench/{task}:1.0"}))
    own, six = load_suite(tmp_path)
    assert six.image == "ghcr.io/multimodal-art-projection/nl2repobench/six:1.0"
    assert own.image == "registry.example/own:2"
    assert six.tests_dir is None and not six.scorable
    assert six.unscorable_reason() == "cannot be scored locally: needs image " + six.image


def test_tests_root_and_shipped_tests_with_image(tmp_path):
    d = make_task(tmp_path, "t", files='["pkg/tests", "test_top.py"]', tests=False)
    (d / "hidden" / "pkg" / "tests").mkdir(parents=True)
    (d / "hidden" / "test_top.py").write_text("")
    (d / "gyre-task.json").write_text('{"tests_root": "hidden", "image": "img:1"}')
    t = load_task(d)
    assert t.tests_dir == (d / "hidden").resolve() and t.scorable and t.image == "img:1"
    (d / "gyre-task.json").write_text('{"tests_root": "../elsewhere"}')
    with pytest.raises(SuiteError, match="'t'.*gyre-task.json.*escapes"):
        load_task(d)
    (d / "gyre-task.json").write_text('{"imagee": "x"}')
    with pytest.raises(SuiteError, match="'t'.*gyre-task.json.*unknown keys"):
        load_task(d)


def test_non_strict_skips_broken_tasks(tmp_path, caplog):
    make_task(tmp_path, "good")
    make_task(tmp_path, "pdfplumber", start=None)  # NL2RepoBench ships two tasks like this
    with pytest.raises(SuiteError, match="pdfplumber.*--strict"):
        load_suite(tmp_path, strict=True)
    tasks = load_suite(tmp_path)  # the default: skip and count
    assert [t.name for t in tasks] == ["good"]
    assert "pdfplumber" in caplog.text


def test_not_a_suite(tmp_path):
    with pytest.raises(SuiteError, match="not a directory"):
        load_suite(tmp_path / "nope")
    with pytest.raises(SuiteError, match="no loadable task folders"):
        load_suite(tmp_path)


def nl2repo_repository(root):
    """A fixture shaped like the published repository: test_files/<task>/ with the four files,
    no tests, no Gyre metadata; one task whose start.md failed to download."""
    tf = root / "test_files"
    for name, count in (("aiofiles", "202"), ("arguably", "70")):
        make_task(tf, name, commands='["pip install -e .", "pytest --continue-on-collection-errors tests"]',
                  count=count, files='["tests"]', tests=False)
    d = make_task(tf, "python-slugify", start=None, tests=False)
    (d / "start.md.download_failed.txt").write_text("download failed")
    (tf / ".DS_Store").write_bytes(b"\0\0")
    return root


def test_published_repository_is_read_unchanged(tmp_path):
    root = nl2repo_repository(tmp_path / "NL2RepoBench")
    suite = read_suite(root)  # the repository root stands for its test_files/
    assert suite.root == (root / "test_files").resolve()
    assert [t.name for t in suite.tasks] == ["aiofiles", "arguably"]
    assert [name for name, _ in suite.skipped] == ["python-slugify"]
    assert "start.md: missing" in suite.skipped[0][1]
    a = suite.tasks[0]
    assert a.image == "ghcr.io/multimodal-art-projection/nl2repobench/aiofiles:1.0" and a.tests_dir is None
    assert a.test_commands == ("pip install -e .", "pytest --continue-on-collection-errors tests")
    other = read_suite(root, image_template="registry.site/nl2repo/{task}:v2").tasks[1]
    assert other.image == "registry.site/nl2repo/arguably:v2"
    with pytest.raises(SuiteError, match="python-slugify.*start.md.*missing.*--strict"):
        read_suite(root, strict=True)


def test_link_inside_shipped_tests_leading_outside_is_refused(tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_text("SECRET = 1\n")
    d = make_task(tmp_path / "suite", "linky")
    os.symlink(outside, d / "tests" / "conftest.py")
    make_task(tmp_path / "suite", "fine")
    with pytest.raises(SuiteError, match="'linky'.*tests/conftest.py is a link leading outside"):
        load_suite(tmp_path / "suite", strict=True)
    assert [t.name for t in load_suite(tmp_path / "suite")] == ["fine"]
    # a link that stays inside the task is kept
    (d / "tests" / "conftest.py").unlink()
    os.symlink("test_x.py", d / "tests" / "alias.py")
    assert [t.name for t in load_suite(tmp_path / "suite", strict=True)] == ["fine", "linky"]


def test_gyre_tasks_lists_scorability_and_skips(tmp_path, capsys):
    from gyre.cli import main

    root = nl2repo_repository(tmp_path / "NL2RepoBench")
    assert main(["tasks", str(root)]) == 0
    out = capsys.readouterr().out
    assert "aiofiles" in out and "arguably" in out and "python-slugify" in out
    assert "2 tasks, 0 scorable here, 2 not; 1 broken task folders skipped" in " ".join(out.split())
    assert "harness.image_dir is not set" in " ".join(out.split())
    assert main(["tasks", "builtin"]) == 0
    assert "8 tasks, 8 scorable here" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["tasks", "{root}", "--strict"], ["rollout", "--strict", "harness.suite={root}"],
                                  ["rollout", "harness.suite={root}/nope"]])
def test_suite_errors_are_one_clear_line(tmp_path, capsys, argv):
    from gyre.cli import main

    root = nl2repo_repository(tmp_path / "NL2RepoBench")
    assert main([a.replace("{root}", str(root)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gyre {argv[0]}: configuration error: ") and "Traceback" not in err
    assert ("python-slugify" in err and "start.md: missing" in err) or "not a directory" in err

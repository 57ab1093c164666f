"""NL2RepoBench's scoring rules, exactly as its official post-processor applies them.

Source: ``openhands/post_processor.py`` of github.com/multimodal-art-projection/NL2RepoBench
(``remove_package_files``, ``remove_test_files``, ``run_test_commands``,
``analyze_pytest_results``). Restated here, not copied:

- each command of ``test_commands.json`` is split with ``shlex.split`` and executed without a
  shell, in ``/workspace`` of a fresh container of the task's image;
- the output of every command whose text contains "pytest" (case-insensitive) is read line by
  line; on each line the *first* match of ``(\\d+) passed`` adds to the passed count (likewise
  ``(\\d+) failed`` and ``(\\d+) error``, reported but not scored);
- score = min(passed / test_case_count, 1);
- a post-processing failure (no image, the container cannot start, ...) yields no score, which
  the benchmark's tables count as 0.

Nothing here decides *how* commands run; the evaluator does that in the task environment.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Iterable

# The official list, matched by file name at any depth of the candidate repository.
PACKAGING_FILES = frozenset({
    "setup.py", "pyproject.toml", "setup.cfg", "requirements.txt", "requirements-dev.txt",
    "requirements-test.txt", "tox.ini", "pytest.ini", "poetry.lock", "Pipfile", "Pipfile.lock",
    "environment.yml", "conda-env.yaml", "manifest.in", "MANIFEST.in",
})
_PASSED = re.compile(r"(\d+) passed")
_FAILED = re.compile(r"(\d+) failed")
_ERROR = re.compile(r"(\d+) error")


class CommandError(ValueError):
    """A test command that ``shlex.split`` cannot parse (unbalanced quotes) or that is empty."""


def split_command(command: str) -> list[str]:
    """argv of a test command, as the official runner builds it (no shell)."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise CommandError(f"test command {command!r} cannot be split: {e}") from None
    if not argv:
        raise CommandError(f"test command {command!r} is empty")
    return argv


OUTPUT_MODES = ("official", "merged")


def command_output(argv: list[str], rc: int | None, stdout: str, stderr: str, mode: str = "official") -> str:
    """The text the scorer reads for one command.

    ``official``: as NL2RepoBench's runner gets it. It runs each command with python-on-whales'
    ``container.execute``, which returns stdout alone when the command succeeds, and otherwise
    raises a DockerException whose text (what the runner keeps) names the command and holds
    stdout and stderr; that text is restated here from python_on_whales/exceptions.py.
    ``merged``: stdout then stderr, whatever the exit status."""
    if mode == "merged":
        return stdout + stderr
    if rc == 0:
        return stdout
    cmd = " ".join(["docker", "exec", "--workdir", "/workspace", "<container>", *argv])
    text = f"The docker command executed was `{cmd}`.\nIt returned with code {rc if rc is not None else -1}\n"
    text += f"The content of stdout is '{stdout}'\n" if stdout else "The command executed did not output anything to stdout\n"
    text += f"The content of stderr is '{stderr}'\n" if stderr else "The command executed did not output anything to stderr\n"
    return text


def is_pytest_command(command: str) -> bool:
    return "pytest" in command.lower()


@dataclass(frozen=True)
class OfficialCounts:
    passed: int
    failed: int
    errors: int
    total: int

    @property
    def score(self) -> float:
        return min(self.passed / self.total, 1.0) if self.total > 0 else 0.0


def count_outputs(results: Iterable[tuple[str, str]], total: int) -> OfficialCounts:
    """``results``: (command, its combined output) per command run, in order."""
    passed = failed = errors = 0
    for command, output in results:
        if not is_pytest_command(command):
            continue
        for line in output.split("\n"):
            for rx, kind in ((_PASSED, "p"), (_FAILED, "f"), (_ERROR, "e")):
                m = rx.search(line)
                if m:
                    n = int(m.group(1))
                    if kind == "p":
                        passed += n
                    elif kind == "f":
                        failed += n
                    else:
                        errors += n
    return OfficialCounts(passed, failed, errors, total)

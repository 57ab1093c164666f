"""Scoring of the learnable suite: one pure function per task, graded in LEVELS levels.

Pure and standard-library only. It is used three ways, which must agree:

* each task ships a byte-identical copy as ``tests/answer_scoring.py``; its pytest file runs one
  test per level (test i passes iff ``level_passes(task, answer, i)``), so the evaluator's reward
  passed / test_case_count is :func:`reward`;
* ``benchmarks/learnability_check.py`` scores sampled answers with :func:`reward` directly;
* ``tests/harness/test_learnable_suite.py`` checks that the copies are identical to this file.

Tasks (the answer is the text the harness wrote to ``answer.txt``):

``short_answer``  n = characters of the answer without leading/trailing whitespace;
                  level i passes iff 1 <= n <= 140 - 13*i (127, 114, ..., 23, 10).
``no_letters``    f = fraction of the answer's non-whitespace characters that are not letters
                  (``str.isalpha`` is false: digits, punctuation, symbols, control characters);
                  level i passes iff f >= i/40 (0.025, 0.05, ..., 0.25). An answer with no
                  non-whitespace character has f = 0.

The levels are placed where the random tiny model's answers fall (24 tokens of pseudo-words,
about 110 characters with 4% non-letters), so that an untrained policy already passes one or two
levels and the members of a group differ; see README.md.
"""

from __future__ import annotations

from pathlib import Path

LEVELS = 10
TASKS = ("no_letters", "short_answer")


def answer_length(text: str) -> int:
    return len(text.strip())


def non_letter_counts(text: str) -> tuple[int, int]:
    """(non-letters, all) among the non-whitespace characters."""
    chars = [c for c in text if not c.isspace()]
    return sum(not c.isalpha() for c in chars), len(chars)


def non_letter_fraction(text: str) -> float:
    k, n = non_letter_counts(text)
    return k / n if n else 0.0


def level_passes(task: str, text: str, level: int) -> bool:
    if not 1 <= level <= LEVELS:
        raise ValueError(f"level must be in 1..{LEVELS}, got {level}")
    if task == "short_answer":
        return 1 <= answer_length(text) <= 140 - 13 * level
    if task == "no_letters":
        k, n = non_letter_counts(text)
        return n > 0 and 40 * k >= level * n  # f >= level/40, in integers
    raise KeyError(f"unknown task {task!r}; known: {TASKS}")


def describe(task: str, text: str, level: int) -> str:
    """Why a level failed, for the pytest log."""
    if task == "short_answer":
        return f"level {level}: answer has {answer_length(text)} characters, needs 1..{140 - 13 * level}"
    return (f"level {level}: {non_letter_fraction(text):.3f} of the non-whitespace characters are "
            f"not letters, needs >= {level / 40:.3f}")


def passed(task: str, text: str) -> int:
    return sum(level_passes(task, text, i) for i in range(1, LEVELS + 1))


def reward(task: str, text: str) -> float:
    """passed / LEVELS: what the evaluator reports for a workspace whose answer.txt holds ``text``."""
    return passed(task, text) / LEVELS


def read_answer(path: str | Path) -> str:
    """The answer file's text exactly as written (no newline translation); invalid UTF-8 replaced."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")

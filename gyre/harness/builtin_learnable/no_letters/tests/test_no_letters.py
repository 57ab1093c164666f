"""Graded tests of the learnable suite's `no_letters` task: test i passes iff the answer reaches level i.

The rule is in answer_scoring.py (a copy of gyre/harness/builtin_learnable/scoring.py), loaded by
path so that neither pytest's import mode nor the candidate's files can change it.
"""

import importlib.util
from pathlib import Path

import pytest

TASK = "no_letters"
ANSWER = Path(__file__).resolve().parents[1] / "answer.txt"

_spec = importlib.util.spec_from_file_location("answer_scoring", Path(__file__).with_name("answer_scoring.py"))
scoring = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scoring)


@pytest.fixture(scope="module")
def answer():
    if not ANSWER.is_file():
        pytest.fail("the harness wrote no answer.txt")
    return scoring.read_answer(ANSWER)


@pytest.mark.parametrize("level", range(1, scoring.LEVELS + 1))
def test_level(answer, level):
    assert scoring.level_passes(TASK, answer, level), scoring.describe(TASK, answer, level)

"""A task whose tests cannot be collected scores 0 whatever the candidate did: the evaluator says
so (a note on the evaluation, one console warning per task) instead of a silent 0."""

from __future__ import annotations

from gyre.harness import evaluator

PYTEST_OUT = """============================= test session starts ==============================
collected 0 items / 1 error

==================================== ERRORS ====================================
_____________________ ERROR collecting tests/test_calc.py ______________________
ImportError while importing test module '/workspace/tests/test_calc.py'.
E   ModuleNotFoundError: No module named 'calc'
=========================== short test summary info ============================
ERROR tests/test_calc.py
!!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!
=============================== 1 error in 0.05s ===============================
"""


def test_collection_error_is_found_and_told_once_per_task(capsys):
    assert evaluator.collection_error(["3 passed in 0.1s", PYTEST_OUT]) == "ERROR collecting tests/test_calc.py"
    assert evaluator.collection_error(["1 failed, 2 passed in 0.1s"]) == ""
    evaluator.warn_uncollected("calc-task", "ERROR collecting tests/test_calc.py", "/run/logs/x/eval.log")
    evaluator.warn_uncollected("calc-task", "ERROR collecting tests/test_calc.py", "/run/logs/y/eval.log")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "task calc-task: tests could not be collected" in err[0] and "/run/logs/x" in err[0]

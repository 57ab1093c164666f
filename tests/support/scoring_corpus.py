"""Pytest outputs on which Gyre's scorer must agree with NL2RepoBench's official post-processor.

Each case: the commands run and what each printed, the task's test_case_count, and the passed
count the official rules give (worked out by hand from openhands/post_processor.py:
analyze_pytest_results: commands whose text contains "pytest", case-insensitively; every output
line; the first "(\\d+) passed" match of each line; score = min(passed / count, 1)).
"""

CASES = [
    # (name, [(command, output), ...], test_case_count, official passed)
    ("plain summary", [("pytest tests", "collected 5 items\n\ntests/test_a.py .....\n\n"
                                        "============================== 5 passed in 0.12s ==============================\n")], 10, 5),
    ("failures and passes", [("pytest -q tests", "....F.FF..\n==== 3 failed, 7 passed in 1.01s ====\n")], 10, 7),
    ("two pytest commands are summed", [("pytest tests/unit", "== 2 passed in 0.1s =="),
                                        ("pytest tests/integration", "== 3 passed, 1 failed in 0.3s ==")], 8, 5),
    ("a non-pytest command's output is ignored", [("python run_tests.py", "100 passed\n"),
                                                  ("pytest tests", "== 1 passed in 0.1s ==")], 4, 1),
    ("pip install with 'pytest' in the command counts", [("pip install pytest-asyncio", "build log: 12 passed checks\n"),
                                                         ("pip install -e .", "ERROR: no setup.py\n 9 passed")], 20, 12),
    ("case-insensitive command match", [("python -m PyTest tests", "== 4 passed in 0.2s ==")], 4, 4),
    ("a print that looks like a summary counts", [("pytest tests", "tests/test_a.py 42 passed (printed by a test)\n"
                                                                   ".\n== 1 passed in 0.1s ==\n")], 100, 43),
    ("text after the summary counts", [("pytest tests", "== 2 passed in 0.1s ==\nteardown: 3 passed\n")], 10, 5),
    ("collection errors", [("pytest --continue-on-collection-errors tests",
                            "==================================== ERRORS ====================================\n"
                            "_____________ ERROR collecting tests/test_b.py _____________\n"
                            "ImportError while importing test module\n"
                            "=========================== short test summary info ============================\n"
                            "ERROR tests/test_b.py\n"
                            "==================== 4 passed, 2 errors in 0.30s ====================\n")], 10, 4),
    ("interrupted by collection errors", [("pytest tests", "!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection "
                                                           "!!!!!!!!!!!!!!!!!!!\n=============== 1 error in 0.12s ===============\n")], 5, 0),
    ("more passed than counted is capped at 1", [("pytest tests", "== 5 passed in 0.1s ==")], 3, 5),
    ("only the first match on a line", [("pytest tests", "1 passed 2 passed\n")], 10, 1),
    ("verbose PASSED lines do not count", [("pytest -v tests", "tests/test_a.py::test_x PASSED [ 50%]\n"
                                                               "tests/test_a.py::test_y PASSED [100%]\n== 2 passed in 0.1s ==")], 2, 2),
    ("xpassed is not passed", [("pytest tests", "== 1 xpassed, 10 passed in 0.2s ==")], 20, 10),
    ("no tests ran", [("pytest tests", "== no tests ran in 0.01s ==")], 5, 0),
    ("colours do not hide the count", [("pytest --color=yes tests", "\x1b[32m\x1b[1m6 passed\x1b[0m\x1b[32m in 0.1s\x1b[0m")], 6, 6),
    ("a command that could not start", [("pytest tests", "exec pytest: [Errno 2] No such file or directory: 'pytest'")], 5, 0),
    ("Windows line ends", [("pytest tests", "== 3 passed in 0.1s ==\r\n")], 3, 3),
]


# Commands with their exit status, stdout and stderr apart (issue 24): what the official runner
# reads of each depends on how it ended (python-on-whales' container.execute returns stdout alone
# on success; on failure its DockerException text, which names the command and holds stdout and
# stderr). (name, [(command, exit status, stdout, stderr), ...], test_case_count, official passed,
# passed when stdout and stderr are merged)
STREAM_CASES = [
    ("success: stderr is not read", [("pytest tests", 0, "== 5 passed in 0.1s ==\n",
                                      "warning: plugin says 1 passed\n")], 10, 5, 6),
    ("failure: stdout is read inside the error text", [("pytest tests", 1, "....FF...\n== 2 failed, 7 passed in 0.3s ==\n",
                                                        "")], 10, 7, 7),
    ("failure: stderr is read too", [("pytest tests", 1, "== 1 failed, 3 passed in 0.2s ==\n",
                                      "teardown: 1 passed\n")], 10, 4, 4),
    ("success with the summary on stderr only", [("pytest tests", 0, "", "== 7 passed in 0.1s ==\n")], 7, 0, 7),
    ("collection interrupted", [("pytest tests", 2, "== 1 error in 0.1s ==\n", "")], 5, 0, 0),
    ("a failed install is not read", [("pip install -e .", 1, "", "12 passed\n"),
                                      ("pytest tests", 0, "== 4 passed in 0.1s ==\n", "")], 4, 4, 4),
    ("a failed command's own words are read", [("pytest -k '3 passed' tests", 1, "== 1 failed in 0.1s ==\n", "")],
     10, 3, 0),
    ("success then failure are summed", [("pytest tests/a", 0, "== 2 passed in 0.1s ==\n", "1 passed\n"),
                                         ("pytest tests/b", 1, "== 1 failed, 1 passed in 0.1s ==\n", "")], 5, 3, 4),
]


def official_score(passed: int, count: int) -> float:
    return min(passed / count, 1.0) if count > 0 else 0.0

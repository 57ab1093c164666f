"""Gyre's scorer against NL2RepoBench's official rules, over a corpus of pytest outputs; and,
where the benchmark's repository is at hand, against its own analyze_pytest_results."""

from __future__ import annotations

import pytest

from gyre.harness import scoring
from gyre.harness.evaluator import parse_pytest_summary

from support.scoring_corpus import CASES, STREAM_CASES, official_score
from support.official_scorer import load_official


def test_corpus_is_large_enough():
    assert len(CASES) + len(STREAM_CASES) >= 25


def _as_read(results, mode):
    return [(c, scoring.command_output(scoring.split_command(c), rc, out, err, mode)) for c, rc, out, err in results]


@pytest.mark.parametrize("name,results,count,passed,merged", STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
def test_stdout_and_stderr_as_the_official_runner_reads_them(name, results, count, passed, merged):
    assert scoring.count_outputs(_as_read(results, "official"), count).passed == passed
    assert scoring.count_outputs(_as_read(results, "merged"), count).passed == merged  # eval.output = "merged"
    official = load_official()
    if official is not None:
        ref = official([{"command": c, "output": o} for c, o in _as_read(results, "official")], count)
        assert ref["passed"] == passed


def test_parity_figures():
    """All cases against the official function where it is at hand: the figures the rollout
    benchmark reports (scoring_parity_cases, scoring_parity_mismatches)."""
    official = load_official()
    if official is None:
        pytest.skip("the NL2RepoBench repository is not at hand (GYRE_NL2REPOBENCH)")
    cases, mismatches = parity(official)
    assert cases >= 25 and mismatches == []


def parity(official) -> tuple[int, list[str]]:
    mismatches = []
    everything = [(n, r, c) for n, r, c, _ in CASES] + [(n, _as_read(r, "official"), c) for n, r, c, _, _ in STREAM_CASES]
    for name, results, count in everything:
        ref = official([{"command": c, "output": o} for c, o in results], count)
        got = scoring.count_outputs(results, count)
        if (got.passed, got.failed, got.errors, got.score) != (ref["passed"], ref["failed"], ref["errors"],
                                                                ref["success_rate"]):
            mismatches.append(name)
    return len(everything), mismatches


@pytest.mark.parametrize("name,results,count,passed", CASES, ids=[c[0] for c in CASES])
def test_official_rules(name, results, count, passed):
    got = scoring.count_outputs(results, count)
    assert got.passed == passed
    assert got.score == official_score(passed, count)


@pytest.mark.parametrize("name,results,count,passed", CASES, ids=[c[0] for c in CASES])
def test_same_as_the_official_function(name, results, count, passed):
    official = load_official()
    if official is None:
        pytest.skip("the NL2RepoBench repository is not at hand (GYRE_NL2REPOBENCH)")
    ref = official([{"command": c, "output": o} for c, o in results], count)
    got = scoring.count_outputs(results, count)
    assert (got.passed, got.failed, got.errors, got.score) == (ref["passed"], ref["failed"], ref["errors"],
                                                                 ref["success_rate"])


def test_the_old_last_summary_reader_would_disagree():
    # why the scorer changed: reading only each command's last summary line misses prints and
    # text after the summary, and reads non-pytest commands
    disagree = [name for name, results, count, passed in CASES
                if sum((parse_pytest_summary(o) or {}).get("passed", 0) for _, o in results) != passed]
    assert len(disagree) >= 4, disagree


def test_commands_are_split_without_a_shell():
    assert scoring.split_command('pytest -k "not slow" tests') == ["pytest", "-k", "not slow", "tests"]
    assert scoring.split_command("cd sub && pytest") == ["cd", "sub", "&&", "pytest"]  # no shell: no &&
    with pytest.raises(scoring.CommandError, match="cannot be split"):
        scoring.split_command('pytest "unterminated')

"""benchmarks/bench_nl2repo.py's "Paper vs Gyre" rows: every "holds" is a test that can fail."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gyre.sim import calibration as cal

_spec = importlib.util.spec_from_file_location(
    "bench_nl2repo", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_nl2repo.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _runs(slack: float) -> list[dict]:
    rows = [{"preset": cal.P122B.name, "label": "E0", "hours": 10.0, "slack": slack},
            {"preset": cal.P122B.name, "label": "C2", "hours": 12.0, "slack": None},
            {"preset": cal.P122B.name, "label": "E0 b4", "hours": 9.0, "slack": None}]
    for k in (0, 2):
        rows += [{"preset": cal.P2P4T.name, "label": f"E{k}", "hours": 50.0},
                 {"preset": cal.P2P4T.name, "label": f"C{k}", "hours": 60.0},
                 {"preset": cal.P2P4T.name, "label": f"A{k}", "hours": 70.0, "best_async_split": 3,
                  "async_half_hours": 75.0}]
    return rows


def _ratios(lo: float) -> dict:
    span = {"min": lo, "median": 1.1, "max": 1.3, "n": 4}
    return {f"{s}{k}/E{k}": span for s in ("A", "C") for k in (0, 2)}


@pytest.mark.parametrize("slack, holds", [(0.2085, True), (0.19, True), (0.05, False), (0.4, False)])
def test_slack_row_fails_outside_the_pinned_band(slack, holds):
    row = next(c for c in bench.paper_vs_gyre(_runs(slack), _ratios(1.0)) if "slack" in c["claim"])
    assert row["holds"] is holds


@pytest.mark.parametrize("lo, holds", [(1.0, True), (1.02, True), (0.97, False)])
def test_family_ratio_rows_fail_where_a_baseline_beats_e(lo, holds):
    rows = [c for c in bench.paper_vs_gyre(_runs(0.2085), _ratios(lo)) if "family" in c["claim"]]
    assert len(rows) == 2 and all(r["holds"] is holds for r in rows)

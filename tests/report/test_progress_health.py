"""What a user watching a run is told: the line per step (gyre/report/progress.py), the health
warnings (gyre/report/health.py), every step figure under a grouped metric name, metrics sinks that
close quietly when a backend breaks, and the resolved configuration stored and shown."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest

from gyre.events import (CallRecorded, ExecutionEvaluated, ExecutionStarted, GroupLag, RunStarted, RunStats,
                         StepEnded)
from gyre.report.health import KINDS, Health, Thresholds
from gyre.report.metrics import MetricsSink, metric_name, row_scalars
from gyre.report.progress import Progress


def step_events(rewards: list[float], *, step: int = 0, t0: float = 100.0, status: str = "done") -> list:
    """One group of len(rewards) executions of task `sum`, each 2 calls of 10 in / 5 out tokens,
    10 s long, 40 unique tokens; the step ends 20 s after t0."""
    ev = [RunStarted(t0, 1)] if step == 0 else []
    for k, r in enumerate(rewards):
        eid = f"q{step}-sum-g{k}"
        ev += [ExecutionStarted(t0, eid, step, "sum"),
               CallRecorded(t0 + 1, t0 + 2, 0, eid, 10, 5), CallRecorded(t0 + 3, t0 + 4, 0, eid, 12, 5),
               ExecutionEvaluated(t0 + 10, eid, step, status, r, step, 40.0, True)]
    ev.append(StepEnded(t0, t0 + 20, step, step + 1, (GroupLag(step, step, 0, 0, 160.0),), (), (0,), True))
    return ev


def fold(events: list, stats: RunStats | None = None) -> tuple[RunStats, dict]:
    st = stats or RunStats()
    row = None
    for e in events:
        row = st.apply(e) or row
    return st, row


def test_step_row_has_the_dashboard_figures():
    _, row = fold(step_events([0.0, 1.0, 1.0, 0.0]))
    assert row["reward_std"] == pytest.approx(0.5) and row["reward_by_task"] == {"sum": 0.5}
    assert row["calls_per_execution"] == 2 and row["call_input_tokens_mean"] == 11 and row["call_output_tokens_mean"] == 5
    assert row["execution_s_mean"] == 10 and row["execution_tokens_mean"] == 40
    assert row["tokens_per_s"] == pytest.approx(160 / 20) and row["executions_per_h"] == pytest.approx(4 * 180)
    assert row["executions_done"] == 4 and row["executions_running"] == 0 and row["harness_failure_rate"] == 0


def test_executions_stopped_by_a_limit_are_counted_on_the_step_line():
    ev = step_events([0.0, 1.0, 0.0])
    ev[4] = replace(ev[4], status="failed", limit="max_workspace_files")
    ev[8] = replace(ev[8], limit="max_processes")
    ev[12] = replace(ev[12], status="failed", limit="max_workspace_files")
    _, row = fold(ev)
    assert row["stopped_by_limits"] == {"max_workspace_files": 2, "max_processes": 1}
    line = Progress(1, 3, out=io.StringIO()).step_line(row)
    assert "3 stopped by limits: max_processes x1, max_workspace_files x2" in line
    _, quiet = fold(step_events([1.0]))
    assert quiet["stopped_by_limits"] == {} and "limits" not in Progress(1, 1, out=io.StringIO()).step_line(quiet)


def test_progress_prints_a_line_per_step_with_eta_and_tells_a_warning_once():
    out = io.StringIO()
    prog = Progress(4, 4, out=out)
    st = RunStats()
    for step in range(2):
        for e in step_events([1.0, 0.0, 1.0, 1.0], step=step, t0=100.0 + 20 * step):
            row = st.apply(e)
            if row is not None:
                row["warnings"] = {"entropy_low": "entropy 0.01 < 0.05"}
            prog.on_event(e, st, row)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("gyre: step 1/4  reward 0.75±0.43 (n 4)  exec 4 done 0 running  8 tok/s  lag 0.00/0")
    assert "ETA 1m00s" in lines[0] and "warn: entropy_low" in lines[0]  # 20 s a step, 3 to go
    assert lines[1] == "gyre: warning: step 1: entropy 0.01 < 0.05"
    assert lines[2].startswith("gyre: step 2/4") and "ETA 40s" in lines[2]
    assert len(lines) == 3  # the second step names the warning on its line, not in full again
    prog.end(2, 40.0, cancelled=True, resume_hint="gyre run --resume run.dir=r")
    assert out.getvalue().splitlines()[-1] == "gyre: run cancelled at step 2/4 after 40s; resume with: gyre run --resume run.dir=r"
    prog.end(4, 3700.0)
    assert out.getvalue().splitlines()[-1] == "gyre: run ended: 4/4 steps in 1h01m"


def test_progress_bar_counts_the_steps_executions_and_keeps_step_lines_whole():
    pytest.importorskip("tqdm")
    out = io.StringIO()
    prog = Progress(2, 4, out=out, bar=True)
    st = RunStats()
    for e in step_events([1.0, 0.0, 1.0, 1.0])[:-1]:
        prog.on_event(e, st, st.apply(e))
    assert prog._bar.n == 4 and prog._bar.total == 4
    ev = step_events([1.0])[-1]
    prog.on_event(ev, st, st.apply(ev))
    assert prog._bar.n == 0  # a new step's bar
    assert any(line.startswith("gyre: step 1/2") for line in out.getvalue().replace("\r", "\n").splitlines())
    prog.end(1, 20.0)
    assert prog._bar is None


@pytest.mark.parametrize("rewards, row_extra, kind", [
    ([1.0, 1.0, 1.0, 1.0], {}, "reward_variance_zero"),
    ([0.0, 1.0], {"entropy": 0.01}, "entropy_low"),
    ([0.0, 1.0], {"replaced_zero_variance": 4}, "replacements_exhausted"),
    ([0.0, 1.0], {"clip_frac": 1.0}, "clip_stuck"),
])
def test_health_warns_and_names_what_to_look_at(rewards, row_extra, kind):
    _, row = fold(step_events(rewards))
    row.update(row_extra)
    said = Health(Thresholds()).check(row)
    assert list(said) == [kind], said
    assert "look at" in said[kind]


def test_health_is_quiet_on_a_healthy_step_and_counts_streaks_and_failures():
    h = Health(Thresholds(harness_failure_rate=0.4))
    _, row = fold(step_events([0.0, 1.0, 0.5]))
    assert h.check({**row, "entropy": 2.0, "clip_frac": 0.01, "replaced_zero_variance": 1}) == {}
    stale = {**row, "clip_frac": 0.0, "staleness_max": 1}
    assert [h.check(stale) for _ in range(3)][-1].keys() == {"clip_stuck"}  # 3 steps in a row
    assert h.check({**row, "clip_frac": 0.0, "staleness_max": 0}) == {}     # on-policy: a 0 is normal
    _, failing = fold(step_events([0.0, 1.0, 0.0], status="crashed"))
    assert "harness_failures" in Health(Thresholds(harness_failure_rate=0.4)).check(failing)


def test_every_step_figure_has_a_grouped_metric_name():
    _, row = fold(step_events([0.0, 1.0]))
    row.update({"mismatch_k3_lag0": 1e-6, "ratio_q50": 1.0, "loss_per_target": 0.1, "entropy": 1.2,
                "learning_rate": 1e-4, "clip_frac": 0.0, "truncated_frac": 0.0, "is_weight_mean": 1.0,
                "replaced_share": 0.0, "warnings": {"entropy_low": "..."}})
    scalars = row_scalars(row)
    assert not [k for k in scalars if k.startswith("other/")], scalars
    assert {k.split("/")[0] for k in scalars} <= {"rollout", "train", "offpolicy", "sched", "health"}
    assert scalars["health/entropy_low"] == 1.0 and scalars["health/reward_variance_zero"] == 0.0
    assert set(f"health/{k}" for k in KINDS) <= set(scalars)
    assert scalars["rollout/reward_by_task/sum"] == 0.5 and scalars["sched/participants"] == 1.0
    assert metric_name("mismatch_k3_lag3") == "offpolicy/mismatch_k3_lag3"
    assert metric_name("a_new_figure") == "other/a_new_figure"  # never dropped: named for a rule to claim


class _Broken:
    def close(self):
        raise ConnectionResetError(104, "Connection reset by peer")


def test_metrics_sink_closes_quietly_when_a_backend_breaks(tmp_path, capsys):
    sink = MetricsSink(tmp_path, ["jsonl"])
    sink.log(0, {"x": 1.0})
    sink._tb = _Broken()  # as W&B's service is when scancel killed it first
    sink.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["x"] == 1.0
    assert len(sink.errors) == 1 and "ConnectionResetError" in sink.errors[0] and "metrics.jsonl" in sink.errors[0]
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err


def test_resolved_config_round_trips_and_show_marks_what_was_set(tmp_path, capsys):
    from gyre.cli import main
    from gyre.config import load_config
    from gyre.report import config_file

    cfg = load_config(None, ["run.steps=7", "run.loggers=jsonl", "harness.group_size=3"])
    path = config_file.write(cfg, tmp_path)
    assert load_config(path) == cfg
    assert main(["config", "show", "--run", str(tmp_path), "run.seed=5"]) == 0
    out = capsys.readouterr().out
    assert "steps = 7  # set (default 4)" in out and "seed = 5  # set (default 0)" in out
    assert "groups_per_step = 2  # default" in out
    with pytest.raises(SystemExit, match="holds no config.toml"):
        main(["config", "show", "--run", str(tmp_path / "nothing")])


def test_checkpoint_retention_keeps_the_newest_and_never_a_step_being_written(tmp_path):
    from gyre.services.retention import Retention

    for v in range(1, 7):
        (tmp_path / f"v{v}").mkdir()
    (tmp_path / "v2.tmp").mkdir()  # not a version directory: left alone
    for name in ("v2u1", "v3u1", "v5u1"):  # inside a step's updates (train.minibatches_per_step): before v3, v4, v6
        (tmp_path / name).mkdir()
    gone = Retention(tmp_path / "weights", tmp_path, keep_checkpoints=2).after_commit(5, served=5)
    assert sorted(p.name for p in gone) == ["v1", "v2", "v2u1", "v3", "v3u1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2.tmp", "v4", "v5", "v5u1", "v6"]


def test_health_tells_steps_from_1_as_the_live_lines_do():
    _, row = fold(step_events([1.0, 1.0]))
    assert row["step"] == 0  # the records count from 0; people read "step 1"
    said = Health(Thresholds()).check({**row, "replaced_zero_variance": 4})
    assert "rewards of step 1 equal" in said["reward_variance_zero"]
    assert "replaced in step 1," in said["replacements_exhausted"]

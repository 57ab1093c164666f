"""What a live run's report shows and where its metrics go: the step table (80 columns, time that
adds up, readable loss), the Gantt chart's idle shading, and the metrics sink (metrics.jsonl,
TensorBoard event files, W&B offline), all fed by gyre.events."""

from __future__ import annotations

import io
import json
import re

import pytest

from gyre.events import (CallRecorded, CellRoleChanged, ExecutionEvaluated, GroupLag, MicroBatchDone, RunEnded,
                         RunStarted, RunStats, StepEnded)


def events(t0: float = 50.0) -> list:
    """Two cells: cell 0 rolls out (busy 2 of every 10 s), cell 1 switches to train and trains."""
    ev = [RunStarted(t0, 2), CellRoleChanged(t0, 0, "rollout"), CellRoleChanged(t0, 1, "rollout"),
          CellRoleChanged(t0 + 1, 1, "to_train"), CellRoleChanged(t0 + 4, 1, "train")]
    for s in range(3):
        a = t0 + 10 * s
        ev += [CallRecorded(a, a + 2, 0, f"e{s}"),
               ExecutionEvaluated(a + 3, f"e{s}", s, "done", 0.25 * s, s, 100.0, True),
               MicroBatchDone(a + 4, a + 7, 1, s, s, True, {"loss": -3.2e-5 * (s + 1), "ratio_mean": 1.0}),
               StepEnded(a + 1, a + 8, s, s + 1, (GroupLag(s, s, 0, 0, 100.0),), (s,), (1,), True, 0.5, 0.1, 0.75,
                         {"clip_frac": 0.125, "audit_mismatched_tokens": 7 * s, "audit_tokens": 90,
                          "audit_first_offender": f"execution e{s} call 3" if s else None})]
    return ev + [RunEnded(t0 + 30)]


def live_report(ev: list) -> dict:
    st = RunStats().extend(ev)
    cells = [{**st.cell_time(c), "hostname": f"node-with-a-long-name-{c}"} for c in st.cell_ids()]
    return {"label": "E0", "wall_s": st.t1 - st.t0, "cells": cells, "steps": st.steps,
            "intervals": {str(c): st.intervals(c) for c in st.cell_ids()},
            "idle": {str(c): st.idle_spans(c) for c in st.cell_ids()}, "errors": []}


def test_live_tables_fit_80_columns_add_up_and_show_the_loss():
    from rich.console import Console

    from gyre.report.live import print_report

    rep = json.loads(json.dumps(live_report(events())))  # as gyre run reads report.json back
    buf = io.StringIO()
    print_report(rep, Console(file=buf, width=80, force_terminal=False, color_system=None))
    out = buf.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "…" not in out, out  # headers wrap, never cut
    for word in ("rollout", "train", "switch", "idle", "failed", "switches", "util", "loss", "grad", "clip", "audit"):
        assert word in out, (word, out)
    assert "-3.2e-05" in out and "±" not in out and "-0.0000" not in out  # a per-token loss stays readable
    assert "14/90" in out and "execution e2 call 3" in out and "12.5%" in out  # the token-truth table
    for c in rep["cells"]:  # busy + switching + idle + failed = wall, per cell
        parts = c["busy_rollout_s"] + c["busy_train_s"] + c["switching_s"] + c["idle_s"] + c["failed_s"]
        assert parts == pytest.approx(c["wall_s"]) == pytest.approx(30.0)
    row0 = next(line for line in out.splitlines() if re.match(r"^\W*0\W", line) and "%" in line)
    nums = [float(x) for x in re.findall(r"\d+\.\d", row0)]
    assert sum(nums[:5]) == pytest.approx(30.0, abs=0.3), row0  # the printed columns add up too


def test_gantt_shades_idle_time_inside_a_role(tmp_path):
    from matplotlib.image import imread

    from gyre.report.live import gantt

    def pale_pixels(rep: dict) -> int:
        img = imread(str(gantt(rep, tmp_path / "g.png")))[..., :3]
        # rollout blue #4C72B0 under white at alpha 0.6
        want = [0.6 + 0.4 * c / 255 for c in (0x4C, 0x72, 0xB0)]
        return int((abs(img - want).max(axis=-1) < 0.03).sum())

    rep = live_report(events())
    assert sum(b - a for a, b in rep["idle"]["0"]) == pytest.approx(rep["cells"][0]["idle_s"]) == pytest.approx(24.0)
    legend_only = pale_pixels({**rep, "idle": {}})  # no idle drawn: the legend's "rollout cell idle" swatch
    assert 0 < legend_only < 400  # the pale blue is explained in the legend
    assert pale_pixels(rep) > legend_only + 500


def test_metrics_sink_writes_jsonl_and_tensorboard_files_readable_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gyre.report.metrics import MetricsSink

    sink = MetricsSink(tmp_path, ["jsonl", "tensorboard"])
    st = RunStats()
    for ev in events():
        sink.on_event(ev, st, st.apply(ev))
    sink.close()
    assert sink.describe()["active"] == ["jsonl", "tensorboard"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "train/loss" in x]
    assert [x["step"] for x in steps] == [0, 1, 2]
    assert [x["train/loss"] for x in steps] == pytest.approx([-3.2e-5, -6.4e-5, -9.6e-5])
    assert [x["rollout/reward_mean"] for x in steps] == [0.0, 0.25, 0.5]
    assert 0 < steps[-1]["cells/utilisation"] < 1 and "cells/cell1/busy_train_s" in steps[-1]
    assert lines[-1]["sched/run_lag_groups"] == 3.0  # the run's lag when it ended
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 1, 2]
    assert [e.value for e in acc.Scalars("rollout/reward_mean")] == pytest.approx([0.0, 0.25, 0.5])


def test_metrics_sink_writes_an_offline_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    from gyre.report.metrics import MetricsSink

    sink = MetricsSink(tmp_path, ["wandb"], name="gyre-test", config={"run": {"steps": 3}})
    st = RunStats()
    for ev in events():
        sink.on_event(ev, st, st.apply(ev))
    sink.close()
    assert "wandb" in sink.describe()["active"], sink.describe()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()  # W&B's own record log; the keys are there in the clear
    assert b"train/loss" in data and b"rollout/reward_mean" in data
    assert (tmp_path / "metrics.jsonl").exists()  # always written


def test_a_resumed_session_continues_the_runs_one_wandb_run(tmp_path):
    """Issue 45: each resume opened a new W&B run; the run's id is kept in run.dir and continued."""
    pytest.importorskip("wandb")
    from gyre.report.metrics import WANDB_ID, MetricsSink

    ids = []
    for first in (0, 3):  # a first session, then one resumed at step 3
        sink = MetricsSink(tmp_path, ["wandb"], name="gyre-test", first_step=first)
        st = RunStats()
        for ev in events():
            sink.on_event(ev, st, st.apply(ev))
        ids.append(sink._wb.id)
        sink.close()
    assert ids[0] == ids[1] == (tmp_path / WANDB_ID).read_text().strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and {r.name for r in runs} == {f"run-{ids[0]}.wandb"}  # `wandb sync` joins them


def test_loggers_are_checked_when_configured(tmp_path):
    from gyre.config import ConfigError, load_config
    from gyre.report.metrics import MetricsSink

    assert load_config(None, ["run.loggers=jsonl,tensorboard"]).run.loggers == ["jsonl", "tensorboard"]
    with pytest.raises(ConfigError, match=r"run.loggers: .*'tensorbored'.*jsonl, tensorboard, wandb"):
        load_config(None, ["run.loggers=jsonl,tensorbored"])
    with pytest.raises(ConfigError, match="run.wandb_mode"):
        load_config(None, ["run.wandb_mode=cloud"])
    sink = MetricsSink(tmp_path, [])  # no backend chosen: metrics.jsonl still
    sink.log(0, {"x": 1.0})
    sink.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "t": None, "x": 1.0}

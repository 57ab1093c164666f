"""`gyre plan`: validation with clear errors, a small sweep, the recommendation, the submitit path."""

from __future__ import annotations

import argparse
import json
import multiprocessing

from pathlib import Path

import pytest

from gyre.cli import main
from gyre.config import ConfigError
from gyre.sim import plan
from gyre.sim.workload import Workload


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    plan.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "8", "--cell-nodes", "3"], "cell size 3 does not divide 8 nodes"),
    (["--nodes", "8", "--cell-nodes", "16"], "zero cells"),
    (["--cells", "0"], "zero or negative cells"),
    (["--nodes", "0"], "must be positive"),
    (["--push-s", "-5"], "times cannot be negative"),
    (["--to-train-s", "-1"], "times cannot be negative"),
    (["--staleness", "-1"], "staleness"),
    (["--train-tokens-per-s", "0"], "must be positive"),
    (["--schemes", "E,Z"], "unknown"),
    (["--workload", "nope"], "not a preset"),
    (["--nodes", "8", "--cell-nodes", "2"], "2-node cell cannot train the 122B-A10B model"),
    (["--steps-per-sync", "0"], "steps-per-sync"),
    (["--gpus-per-node", "0"], "gpus-per-node"),
    (["--train-cost", "0"], "train-cost"),
    (["--tool-s", "-1"], "tool-s"),
    (["--jobs", "0"], "--jobs: at least 1 process"),
])
def test_bad_parameters_get_clear_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        plan.scenarios(args(*argv))


def test_cli_reports_configuration_errors(capsys):
    assert main(["plan", "--nodes", "8", "--cell-nodes", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_small_sweep_prints_table_and_recommends(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--nodes", "8,16", "--cell-nodes", "4,8", "--schemes", "E,A,C", "--staleness", "0",
               "--steps", "3", "--groups-per-step", "2", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "recommended for 8 nodes" in text and "recommended for 16 nodes" in text
    rows = json.loads(out.read_text())
    # 8 nodes: 2x4 (E, A, C) + 1x8 (E, C, and A listed as not evaluated); 16 nodes: 4x4 and 2x8.
    assert len(rows) == 6 + 6
    (skipped,) = [r for r in rows if r.get("skipped")]
    assert skipped["cells"] == 1 and "rollout pool and a training pool" in skipped["skipped"]
    assert "not evaluated" in text
    for n in (8, 16):
        mine = [r for r in rows if r["nodes"] == n and not r.get("skipped")]
        best = [r for r in mine if r["recommended"]]
        assert len(best) == 1 and best[0]["hours"] == min(r["hours"] for r in mine)
        assert all(r["ratio_to_lower_bound"] >= 1.0 for r in mine)
    for r in rows:
        if r.get("scheme") == "A" and not r.get("skipped"):  # Async at its best split, reported
            assert r["hours"] == pytest.approx(min(r["async_hours_by_split"].values()), abs=1e-3)
            assert 1 <= r["async_split"] < r["cells"]


def test_header_names_what_the_plan_assumes(capsys):
    # 4 GPUs per node: a 4-node cell cannot hold the 122B training state, 8 nodes can
    assert main(["plan", "--nodes", "8", "--cell-nodes", "4", "--gpus-per-node", "4"]) == 2
    assert "use cells of at least 5 nodes" in capsys.readouterr().err
    assert main(["plan", "--nodes", "16", "--cell-nodes", "8", "--schemes", "E,C", "--staleness", "0,2",
                 "--steps", "2", "--groups-per-step", "2", "--gpus-per-node", "4", "--train-cost", "3"]) == 0
    text = capsys.readouterr().out
    head = text.split("| nodes")[0]
    assert "nl2repo-122b-32n" in head and "122B-A10B" in head and "4 GPUs per node" in head
    assert "groups per step 2" in head and "training cost x3" in head and "tool time" in head
    # one recommendation per staleness, never ranked across
    assert "recommended for 16 nodes at staleness 0" in text and "recommended for 16 nodes at staleness 2" in text
    # each recommendation comes with the configuration line that runs it
    applies = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("apply: ")]
    assert len(applies) == 2 and all("sched.cells=2 sched.cell_nodes=8" in a for a in applies), applies
    assert {a.split()[2] for a in applies} == {"sched.staleness=0", "sched.staleness=2"}


def test_header_names_the_model_config_planned(tmp_path, capsys):
    from gyre.config import default_tiny_dir, load_config
    from gyre.model.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(default_tiny_dir(load_config(None, [])), "qwen2")
    args_ = args("--nodes", "8", "--cell-nodes", "4", "--model-config", str(tiny))
    head = plan.header(args_)
    assert f"qwen2:{Path(tiny).name}" in head and "122B" not in head.splitlines()[0], head


def test_one_cell_elastic_is_colocate():
    rows = plan.execute(plan.scenarios(args("--nodes", "4", "--cell-nodes", "4", "--schemes", "E,C",
                                            "--staleness", "0,2", "--steps", "2", "--groups-per-step", "2")),
                        "inline")
    by = {r["label"]: r["hours"] for r in rows}
    assert by["E0"] == by["C0"] and by["E2"] == by["C2"]


def test_cells_filter_and_async_skip():
    scs = plan.scenarios(args("--nodes", "16", "--cell-nodes", "4,8", "--cells", "2", "--schemes", "A,E"))
    assert {(s.cluster.cells, s.cluster.cell_nodes) for s in scs} == {(2, 8)}


def test_submitit_local_executor_matches_inline(tmp_path):
    pytest.importorskip("submitit")
    scs = plan.scenarios(args("--nodes", "8", "--cell-nodes", "4", "--schemes", "E,C", "--staleness", "0",
                              "--steps", "2", "--groups-per-step", "2"))
    key = lambda r: (r["label"], r["cells"])  # noqa: E731  (submitit yields jobs as they end)
    inline = sorted(plan.execute(scs, "inline"), key=key)
    local = sorted(plan.execute(scs, "local", jobs_dir=str(tmp_path / "jobs")), key=key)
    assert local == inline


@pytest.mark.parametrize("preset, nodes, cells, numbers", [
    ("nl2repo-122b-32n", "8", "2", ["2.0 TB", "1.80 TB", "at least 3 nodes"]),
    ("nl2repo-2.4t", "384", "4", ["38.4 TB", "3.61 TB", "at least 43 nodes"]),
])
def test_plan_refuses_layouts_that_do_not_fit_memory(capsys, preset, nodes, cells, numbers):
    """Training state (16 bytes/param) against the cell's HBM: refused with the numbers."""
    assert main(["plan", "--preset", preset, "--nodes", nodes, "--cell-nodes", cells]) == 2
    err = capsys.readouterr().err
    assert "cannot train" in err and all(n in err for n in numbers), err


def test_feasible_layouts_pass_the_memory_check():
    from gyre.sim.calibration import MODEL_2P4T, QWEN_122B, check_layout, min_cell_nodes

    assert min_cell_nodes(QWEN_122B) == 3 and min_cell_nodes(MODEL_2P4T) == 43
    check_layout(QWEN_122B, 4)
    check_layout(MODEL_2P4T, 48)
    with pytest.raises(ConfigError, match="42-node cell"):
        check_layout(MODEL_2P4T, 42)


def test_config_sweeps_around_a_real_run(tmp_path):
    """`gyre plan --config run.toml`: the run's schedule is the sweep's default, and what the flags
    do not vary (the burst order, the zero-variance rule) reaches every simulated point."""
    run = tmp_path / "run.toml"
    run.write_text('[run]\nsteps = 3\ngroups_per_step = 2\n[sched]\nscheme = "C"\nstaleness = 1\ncells = 2\n'
                   'cell_nodes = 8\nsteps_per_sync = 2\nburst_order = "shuffle"\nmax_replacements_per_step = 1\n')
    scs = plan.scenarios(args("--config", str(run)))
    assert [(s.scheme, s.staleness, s.cluster.nodes, s.cluster.cell_nodes, s.steps, s.groups_per_step,
             s.steps_per_sync) for s in scs] == [("C", 1, 16, 8, 3, 2, 2)]
    spec = scs[0].spec(Workload.named(scs[0].workload, 0))
    assert spec.core.burst_order == "shuffle" and spec.core.max_replacements_per_step == 1
    assert spec.core.steps == 3 and spec.policy().label == "C1"
    wider = plan.scenarios(args("--config", str(run), "--staleness", "0,2", "--schemes", "E"))
    assert {(s.scheme, s.staleness) for s in wider} == {("E", 0), ("E", 2)}
    with pytest.raises(ConfigError, match="does not exist"):
        plan.scenarios(args("--config", str(tmp_path / "missing.toml")))


def test_colocate_at_high_staleness_with_few_groups_runs():
    """Issue 33's crash: a whole-pool switch evicted a call in flight while no call was decoding
    (ZeroDivisionError in the eviction's re-prefill price)."""
    (s,) = plan.scenarios(args("--nodes", "32", "--cell-nodes", "4", "--staleness", "4",
                               "--groups-per-step", "8", "--steps", "4", "--schemes", "C"))
    r = plan.run_one(s)
    assert not r.get("skipped") and r["hours"] > 0


def test_searched_async_split_is_the_exhaustive_best():
    from gyre.sim.scenario import best_async, nl2repo_cluster
    from gyre.sim.scenario import Scenario
    s = Scenario("A", 1, nl2repo_cluster(nodes=40, cell_nodes=4), steps=3, groups_per_step=4, record=False)
    full, every = best_async(s)
    found, tried = best_async(s, search=True)
    assert len(every) == 9 and len(tried) < len(every)
    assert found.async_rollout_cells == full.async_rollout_cells and found.hours == full.hours


@pytest.mark.parametrize("staleness", [0, 2])
def test_screened_async_search_is_the_full_scans_best(staleness):
    """`gyre plan`'s search (short runs seed the walk, runs given up once they cannot win) lands on
    the full scan's split with the same run, and simulates fewer splits at full length."""
    from gyre.sim.scenario import Scenario, best_async, nl2repo_cluster
    s = Scenario("A", staleness, nl2repo_cluster(nodes=40, cell_nodes=4), steps=6, groups_per_step=4, record=False)
    full, every = best_async(s)
    found, finished = best_async(s, search=True, prune=True, screen_steps=2)
    assert found.async_rollout_cells == full.async_rollout_cells and found.hours == full.hours
    assert found.hours == min(every.values())
    full_length = set(finished) | set(found.async_given_up)
    assert len(every) == 9 and len(full_length) < len(every)
    for k, h in finished.items():  # each split that ran to its end is the scan's run of that split
        assert h == every[k]
    for k, h in found.async_given_up.items():  # given up (or never run: its training floor) below its hours
        assert found.hours <= h <= every[k]


@pytest.mark.parametrize("staleness, nodes, screen", [(1, 48, 2), (0, 48, 0), (2, 56, 2)])
def test_one_neighbour_at_a_time_walk_is_the_full_scans_best(staleness, nodes, screen):
    """The walk runs one neighbour of the best split at a time (the smaller training pool first) and
    moves on as soon as one is faster: it still lands on the full scan's split and run, having
    simulated fewer splits."""
    from gyre.sim.scenario import Scenario, best_async, nl2repo_cluster
    s = Scenario("A", staleness, nl2repo_cluster(nodes=nodes, cell_nodes=4), steps=4, groups_per_step=4,
                 record=False)
    full, every = best_async(s)
    found, finished = best_async(s, search=True, prune=True, screen_steps=screen)
    assert found.async_rollout_cells == full.async_rollout_cells and found.hours == full.hours
    assert found.hours == min(every.values())
    for k, h in finished.items():
        assert h == every[k]
    tried = set(finished) | set(found.async_given_up)
    assert len(tried) < len(every)


def test_training_pool_floor_is_below_every_splits_hours():
    """The floor that skips an Async split without simulating it never exceeds that split's run."""
    from gyre.sim.scenario import Scenario, best_async, nl2repo_cluster, train_pool_floor_s
    for staleness in (0, 2):
        s = Scenario("A", staleness, nl2repo_cluster(nodes=32, cell_nodes=4), steps=4, groups_per_step=8,
                     record=False)
        _, every = best_async(s)
        cell_s, serial_s = train_pool_floor_s(s, Workload.named(s.workload, s.seed))
        floors = {k: (cell_s / (8 - k) + serial_s) / 3600 for k in every}
        assert all(floors[k] < every[k] for k in every), (floors, every)


def test_a_failing_point_is_a_row_and_the_sweep_goes_on(monkeypatch, tmp_path, capsys):
    real = plan.run_one

    def flaky(s):
        if s.scheme == "C":
            raise ZeroDivisionError("float division by zero")
        return real(s)

    monkeypatch.setattr(plan, "run_one", flaky)
    out = tmp_path / "rows.json"
    rc = main(["plan", "--nodes", "8", "--cell-nodes", "4", "--schemes", "E,C", "--staleness", "0",
               "--steps", "2", "--groups-per-step", "2", "--json", str(out), "--jobs", "1"])  # patched in this process
    captured = capsys.readouterr()
    assert rc == 1 and "1 point(s) failed" in captured.err
    rows = {r["label"]: r for r in json.loads(out.read_text())}
    assert rows["E0"]["recommended"] and "ZeroDivisionError" in rows["C0"]["skipped"]


def test_ctrl_c_keeps_the_points_that_finished(monkeypatch, capsys):
    real, seen = plan.run_one, []

    def interrupted_second(s):
        if seen:
            raise KeyboardInterrupt
        seen.append(s)
        return real(s)

    monkeypatch.setattr(plan, "run_one", interrupted_second)
    monkeypatch.setattr(plan, "_guarded", lambda s: plan.run_one(s))  # let the interrupt through
    rc = main(["plan", "--nodes", "8", "--cell-nodes", "4", "--schemes", "E,C", "--staleness", "0",
               "--steps", "2", "--groups-per-step", "2", "--jobs", "1"])
    captured = capsys.readouterr()
    assert rc == 130 and "interrupted: 1 of 2 points" in captured.err
    assert "recommended for 8 nodes" in captured.out and "| E0 |" in captured.out


def test_gpu_kind_and_default_steps_come_from_flags_and_preset():
    a = args("--nodes", "32", "--cell-nodes", "4", "--schemes", "E", "--staleness", "0", "--gpu", "B200")
    (s,) = plan.scenarios(a)
    assert s.steps == plan.preset(a.preset).steps
    h200 = plan.scenarios(args("--nodes", "32", "--cell-nodes", "4", "--schemes", "E", "--staleness", "0"))[0]
    assert s.cluster.replica.hbm_tb_s > h200.cluster.replica.hbm_tb_s  # B200 reads HBM faster


def test_a_pool_of_processes_gives_the_inline_rows_in_the_sweeps_order():
    scs = plan.scenarios(args("--nodes", "8", "--cell-nodes", "4", "--schemes", "A,E,C", "--staleness", "0",
                              "--steps", "2", "--groups-per-step", "2"))
    inline = list(plan.execute(scs, "inline", jobs=1))
    pooled = list(plan.execute(scs, "inline", jobs=2))
    assert [r["label"] for r in pooled] == ["A0", "E0", "C0"]
    assert pooled == inline


def test_the_pool_takes_the_heaviest_points_first():
    """Async (a split search) first, then the higher staleness, then more cells: at 64 nodes the
    last points to start are the cheap staleness-0 runs (no long point starts last)."""
    scs = plan.scenarios(args("--nodes", "64"))
    order = [(s.scheme, s.staleness, s.cluster.cells) for s in sorted(scs, key=plan._weight)]
    assert order[:4] == [("A", 2, 16), ("A", 2, 8), ("A", 0, 16), ("A", 0, 8)]
    assert {s for s, _, _ in order[4:]} == {"E", "C"}
    assert [k for _, k, _ in order[4:]] == [2, 2, 2, 2, 0, 0, 0, 0]


def test_closing_a_pooled_sweep_stops_its_workers():
    scs = plan.scenarios(args("--nodes", "8", "--cell-nodes", "4", "--schemes", "E,C", "--staleness", "0,1,2",
                              "--steps", "2", "--groups-per-step", "2"))
    before = set(multiprocessing.active_children())
    points = plan.execute(scs, "inline", jobs=2)
    first = next(points)
    points.close()  # what Ctrl-C does (gyre plan closes it in its finally)
    assert first["label"] == "E0"
    assert not set(multiprocessing.active_children()) - before

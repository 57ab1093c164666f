"""Where a cell's processes run (gyre.cluster.placement builds it, gyre.cell takes it), and the
cell engine's typed admin calls, without MPI or a running engine."""

from __future__ import annotations

import json

import pytest

from gyre.cell.command import CommandError
from gyre.cell.engine import CellEngine
from gyre.cell.placement import Placement
from gyre.cluster.placement import cell_placement, local_placement
from gyre.config import load_config
from gyre.engine.backends import EngineAdmin, EngineAdminError


def test_local_processes_outside_a_slurm_job(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "slurm.json").write_text(json.dumps({"cells": [{"nodes": ["n1", "n2"]}]}))
    cfg = load_config(None, ["train.local_ranks=2"])
    p = cell_placement(cfg, tmp_path, 0)
    assert p == Placement(nodes=(), srun=None, advertise="127.0.0.1", trainer_ranks=2)
    assert not p.in_slurm_step
    wide = local_placement(load_config(None, ["engine.host=0.0.0.0"]))
    assert wide.advertise not in ("127.0.0.1", "")  # reachable from other machines by name


def test_a_slurm_step_over_the_cells_nodes(tmp_path, monkeypatch):
    for k in ("SLURM_HET_SIZE", "SLURM_JOB_ID_HET_GROUP_0"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    (tmp_path / "slurm.json").write_text(json.dumps({"cells": [{"nodes": ["n1", "n2"]}, {"nodes": ["n3", "n4"]}]}))
    cfg = load_config(None, ["sched.gpus_per_node=0"])
    p = cell_placement(cfg, tmp_path, 1)
    assert p.nodes == ("n3", "n4") and p.in_slurm_step
    assert p.srun == ("srun", "--overlap", "--mpi=none", "--jobid=77")
    assert p.trainer_ranks == 2  # one rank per node where no GPU counts
    # a cell the job's layout does not name runs locally
    assert not cell_placement(cfg, tmp_path, 2).in_slurm_step


class FakeAdmin(EngineAdmin):
    """The backend-neutral admin contract the cell engine calls (each backend implements it over
    its own routes)."""

    def __init__(self, refusals: int = 0):
        self.calls: list[tuple] = []
        self.refusals = refusals

    def abort_all(self):
        self.calls.append(("abort", True))

    def release_memory(self):
        self.calls.append(("release",))
        if self.refusals:
            self.refusals -= 1
            raise EngineAdminError(400, "requests still running", "/release_memory_occupation")

    def resume_memory(self):
        self.calls.append(("resume",))

    def load_weights(self, path, version):
        self.calls.append(("update", path, version))


def _engine(tmp_path, admin: FakeAdmin) -> CellEngine:
    e = CellEngine(load_config(None, []), tmp_path / "model", api_key="k", cell=0, placement=Placement(),
                   pids=None, extra_args=[])
    e.admin = admin
    return e


def test_weights_load_once_per_version_and_need_a_directory(tmp_path):
    admin = FakeAdmin()
    e = _engine(tmp_path, admin)
    e.load(None, None)
    e.load(0, None)  # what it serves already
    with pytest.raises(CommandError, match="needs its weights directory"):
        e.load(1, None)
    e.load(1, tmp_path / "w1")
    e.load("1", tmp_path / "w1")
    assert admin.calls == [("update", str(tmp_path / "w1"), "1")]
    assert (e.version, e.weights) == ("1", str(tmp_path / "w1"))


def test_release_is_retried_while_the_engine_refuses(tmp_path):
    admin = FakeAdmin(refusals=2)
    e = _engine(tmp_path, admin)
    waited = []
    phases: dict = {}
    assert e.drain_and_release(5.0, phases, on_wait=lambda: waited.append(1)) == 2
    assert [c[0] for c in admin.calls] == ["abort", "release", "abort", "release", "abort", "release"]
    assert admin.calls[1] == ("release",) and len(waited) == 2 and phases["release"] >= 0
    with pytest.raises(CommandError, match="refused to release"):
        _engine(tmp_path, FakeAdmin(refusals=10**6)).drain_and_release(0.0, {}, on_wait=lambda: None)

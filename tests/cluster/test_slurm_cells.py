"""Cells on the dev cluster's real nodes: 1 head + 2 cells x 2 nodes, the agent scenario of
tests/mpi_scripts/cell_head.py as one heterogeneous srun step (what `gyre.sbatch` runs).

Each agent starts its trainer as one `srun` step over its cell's two nodes (one rank per node on
CPU). Checked from what the processes report: trainer ranks on both nodes of each cell, an engine
per cell, the reduce over 2 cells x 2 ranks equal to one process on the same micro-batches, a
reduce over one cell while the other leaves (and later rejoins) mid-step, and a trainer death
recovered. Skipped where the dev cluster cannot run (see tests/cluster/test_slurm.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.devcluster import REPO, _tail, cluster, sbatch, wait_gone  # noqa: E402,F401  (cluster: fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
NODES = [["node01", "node02"], ["node03", "node04"]]


def test_cell_scenario_on_two_cells_of_two_nodes(cluster, tmp_path):
    from gyre.model.tiny import ensure_tiny_model

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    # the cell layout `gyre.cluster.slurm prepare` writes for a job: the agents read their nodes there
    (run / "slurm.json").write_text(json.dumps({"cells": [{"cell": i, "nodes": n, "rank_node": n[0]}
                                                          for i, n in enumerate(NODES)]}))
    model = ensure_tiny_model(tmp_path / "tiny")
    key = tmp_path / "engine.key"
    key.write_text("cell-test-key")
    key.chmod(0o600)
    out_json, out = tmp_path / "out.json", tmp_path / "job.out"
    py = sys.executable
    script = tmp_path / "cells.sbatch"
    args = f"{REPO}/tests/mpi_scripts/cell_head.py {run} {model} {key} {out_json}"
    script.write_text(f"""#!/bin/bash
#SBATCH --partition=head --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --partition=cells --nodes=4 --ntasks-per-node=1
cd {REPO}
export PYTHONPATH={REPO}
srun --mpi=pmi2 --kill-on-bad-exit=1 --het-group=0 -N1 -n1 {py} {args} : \\
     --het-group=1 -N2 -n2 --ntasks-per-node=1 -w {NODES[0][0]},{NODES[1][0]} {py} {args}
""")
    job = sbatch(cluster, ["-o", out, script])
    wait_gone(cluster, job, 900, out)
    assert out_json.exists(), _tail(out)
    d = json.loads(out_json.read_text())
    assert "error" not in d, d["error"] + _tail(out)
    for cell, nodes in enumerate(NODES):
        hello = d["hello"][str(cell)]
        assert hello["hostname"] == nodes[0]
        assert sorted(hello["trainer_hosts"]) == nodes, hello  # a rank on each node of the cell
        assert hello["engine_nodes"][0] == nodes[0]
    c = d["checks"]
    assert c["hello_generate"] == [200, 200]  # an engine per cell
    assert c["v1_max_diff"] == 0.0 or c["v1_max_diff"] <= 1e-6  # 2 cells x 2 ranks = one process
    assert c["v2_max_diff"] <= 1e-6  # one cell alone while the other left mid-step
    assert c["v3_max_diff"] <= 1e-6  # after a trainer death, its micro-batches handed to the other cell
    assert all(r["ok"] for r in d["reduce_step0"] + d["reduce_step2"])
    form = [r["info"]["group_form_ms"] for r in d["reduce_step0"]]
    print(f"\ncross-cell group formed in {max(form):.1f} ms (2 cells x 2 ranks over the dev cluster's network)")

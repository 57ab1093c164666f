"""The processes of a job that compute no gradients (the head rank, an MPI rank before it knows its
role) never import torch: its import alone costs ~1 s of CPU per process, and the e2e suite starts
~60 jobs on 2 cores (issue 41). Each check runs in a fresh interpreter, so what another test
imported does not hide a regression."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def heavy_modules(script: str) -> list[str]:
    """Run ``script`` in a fresh Python; the heavy packages it left in sys.modules."""
    heavy = "{'torch', 'transformers', 'megatron'}"
    probe = f"{script}\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy}))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return ast.literal_eval(r.stdout.strip().splitlines()[-1])


def test_the_head_and_the_rank_entry_import_no_torch():
    assert heavy_modules("import gyre.cluster.main, gyre.head, gyre.cluster.local") == []


def test_the_head_builds_sends_and_audits_micro_batches_and_writes_tensorboard_without_torch(tmp_path):
    """What the head does with a step (advantages, materialization into the wire form, the
    token audit) and its metrics sinks (TensorBoard scalars) stay torch-free at run time too."""
    script = f"""
import numpy as np
from gyre.report.metrics import MetricsSink
from gyre.traj.audit import audit_micro_batch
from gyre.traj.materialize import materialize, prepare_step
from gyre.traj.select import SelectionSpec
from gyre.traj.synthetic import Shape, generate_group

recs = generate_group(Shape(seed=3), 3)
step = prepare_step(recs, SelectionSpec(k="all"), step_version=1)
mat = materialize(step.executions, layout="tree", micro_batch_tokens=1 << 16)
wire, keys = mat.wire_with_keys(0)
assert wire["target_ids"].dtype == np.int64 and len(keys) == len(wire["target_ids"]) > 0
audit = audit_micro_batch(wire, keys, step.executions)
assert audit.tokens == len(keys) and audit.mismatched == 0, audit
sink = MetricsSink({str(tmp_path)!r}, ["jsonl", "tensorboard"])
sink.log(0, {{"loss": 1.0}})
sink.close()
assert sink.describe()["active"] == ["jsonl", "tensorboard"], sink.describe()
"""
    assert heavy_modules(script) == []


def test_the_wire_form_is_the_micro_batch_the_trainer_gets():
    """The head sends `build_wire`'s arrays; the trainer's `from_wire` of them equals the
    MicroBatch that materialization builds for trainers and tests (field by field, dtype too)."""
    import torch

    from gyre.batch import from_wire, to_wire
    from gyre.traj.materialize import materialize, prepare_step
    from gyre.traj.select import SelectionSpec
    from gyre.traj.synthetic import Shape, generate_group

    recs = generate_group(Shape(seed=5), 2)
    step = prepare_step(recs, SelectionSpec(k=2), step_version=2)
    mat = materialize(step.executions, layout="tree", micro_batch_tokens=1 << 15)
    assert len(mat) >= 1
    for i in range(len(mat)):
        wire, keys = mat.wire_with_keys(i)
        mb, keys2 = mat.with_keys(i)
        assert (keys == keys2).all()
        assert list(wire) == list(to_wire(mb))
        got = from_wire(wire)
        for name, arr in to_wire(mb).items():
            assert getattr(got, name).dtype == torch.from_numpy(arr).dtype, name
            assert torch.equal(getattr(got, name), torch.from_numpy(arr)), name

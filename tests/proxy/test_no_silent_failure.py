"""Issue 34, item 1: no failure is silent. A record that cannot be written (a full disk or inode
table, injected at the fsio seam) stops the run with what to free, keeps what was recorded, and
never lets a task's exception vanish (the head's fire-and-forget tasks, `gyre rollout`'s jobs)."""

from __future__ import annotations

import asyncio
import errno
import json

import pytest

import gyre.fsio
from gyre.config import GyreConfig
from gyre.events import ExecutionEvaluated
from gyre.services.rollout import RecordError, RolloutService
from gyre.traj.store import iter_executions
from support.replay_head import IDENTITY, execution_done, run_config
from support.head_records import make_head, record
from support.service_records import record as small_record


def failing_fsync(monkeypatch, error: OSError, times: int = 10**9):
    """The fsio seam every durable write goes through raises ``error`` (``times`` times)."""
    real, left = gyre.fsio.fsync_path, [times]

    def fsync(path):
        if left[0] > 0:
            left[0] -= 1
            raise error
        real(path)

    monkeypatch.setattr(gyre.fsio, "fsync_path", fsync)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   OSError(None, "Can't write data (errno = 28, error message = 'No space left "
                                                 "on device')"),  # how HDF5 says it
                                   OSError(errno.EDQUOT, "Disk quota exceeded")])
def test_a_full_disk_stops_recording_with_what_to_free_and_keeps_what_was_recorded(tmp_path, monkeypatch, error):
    svc = RolloutService(GyreConfig(), None, tmp_path, IDENTITY, tmp_path / "shards")
    svc.record([small_record("q0-t-g0", 0)])
    svc.record([small_record("q1-t-g0", 1)])
    failing_fsync(monkeypatch, error)
    with pytest.raises(RecordError) as e:
        svc.record([small_record("q0-t-g1", 0)])
    msg = str(e.value)
    assert "q0-t-g1" in msg and "is full" in msg and "inodes free" in msg and "store.dir" in msg
    assert "--resume" in msg
    with pytest.raises(RecordError, match="each execution's own shard is kept"):
        svc.compact()
    monkeypatch.undo()
    assert sorted(r.execution_id for r in iter_executions(tmp_path / "shards")) == ["q0-t-g0", "q1-t-g0"]
    assert sorted(p.name for p in (tmp_path / "shards").iterdir() if not p.name.endswith(".h5")) == []


def test_a_transient_write_error_is_retried_and_a_lasting_one_is_said(tmp_path, monkeypatch):
    svc = RolloutService(GyreConfig(), None, tmp_path, IDENTITY, tmp_path / "shards")
    failing_fsync(monkeypatch, OSError(errno.EIO, "Input/output error"), times=1)
    svc.record([small_record("q0-t-g0", 0)])  # retried: on disk
    failing_fsync(monkeypatch, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(RecordError, match=r"q0-t-g1: OSError: .*Input/output error \(tried 3 times\)"):
        svc.record([small_record("q0-t-g1", 0)])
    bad = small_record("q0-t-g2", 0)
    bad.tree.calls[0].agent_role = "x\udc80"  # what issue 34 found: a bug must not vanish either
    monkeypatch.undo()
    with pytest.raises(RecordError, match="q0-t-g2: UnicodeEncodeError"):
        svc.record([bad])
    assert [r.execution_id for r in iter_executions(tmp_path / "shards")] == ["q0-t-g0"]


def test_the_head_stops_loudly_when_a_record_cannot_be_written(tmp_path, monkeypatch, capsys):
    head = make_head(tmp_path, run_config(tmp_path, steps=1, q=1, g=2, per_shard=1, skip_zero_variance=False))
    seen = []
    head._emit = lambda ev: seen.append(ev)
    g = head.start_groups(1, 0.0)[0]
    execution_done(head, "q0-task-g0", record("q0-task-g0", g.id, 0, 0, 1.0, "http://engine0"), 10.0)
    failing_fsync(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(RecordError):
        execution_done(head, "q0-task-g1", record("q0-task-g1", g.id, 1, 0, 1.0, "http://engine0"), 11.0)
    # nothing counted what is not on disk: the core and the statistics never heard of it
    assert [e.execution for e in seen if isinstance(e, ExecutionEvaluated)] == ["q0-task-g0"]
    assert "q0-task-g1" not in head.ledger.ended

    async def go():  # the task that ran it fails: the run stops and says why
        del head._spawn  # the real one (replay_head plays executions without tasks)
        t = head._spawn(asyncio.sleep(0, result=None), name="fine")
        await t
        assert head.failed is None and not head._stop.is_set()

        async def execution():
            execution_done(head, "q0-task-g1", record("q0-task-g1", g.id, 1, 0, 1.0, "http://engine0"), 11.0)

        await asyncio.gather(head._spawn(execution(), name="execution q0-task-g1"), return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next turn of the loop

    asyncio.run(go())
    assert head._stop.is_set() and head.failed.startswith("execution q0-task-g1: RecordError: cannot record")
    assert "store.dir" in head.failed and "gyre run: failed: execution q0-task-g1" in capsys.readouterr().err
    rep = head.report(20.0, True)
    assert rep["failed"] == head.failed and head.failed in rep["errors"]
    assert json.dumps(rep, default=str)  # the report itself is writable


@pytest.mark.slow
def test_gyre_rollout_exits_non_zero_naming_the_execution_it_could_not_record(tmp_path, monkeypatch, capsys):
    """Issue 34: on a full store.dir, 7 of 8 executions were dropped and `gyre rollout` exited 0."""
    from gyre import offline_rollout
    from gyre.traj.store import ShardWriter
    from support.rollout_config import cfg_for

    real = ShardWriter.write

    def write(self, records, *a, **kw):
        if any(r.execution_id.endswith("-g1-a0") for r in records):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, records, *a, **kw)

    monkeypatch.setattr(ShardWriter, "write", write)
    cfg = cfg_for(tmp_path / "run", "engine.endpoints=1", 'harness.tasks=["fizzbuzz"]',
                  command=["bash", "-c", "echo 'def fizzbuzz(n): pass' > fizzbuzz.py"])
    monkeypatch.setattr(offline_rollout, "load_config", lambda *a: cfg)
    args = offline_rollout.argparse.Namespace(config=None, overrides=[], resume=False, no_progress=True, validate=False,
                                              strict=False)
    assert offline_rollout.run(args) == 4
    err = capsys.readouterr().err
    assert "fizzbuzz-g1-a0" in err and "store.dir" in err and "gyre rollout: failed" in err
    assert [r.execution_id for r in iter_executions(tmp_path / "run" / "shards")] == ["fizzbuzz-g0-a0"]

"""The typed trainer pipe (gyre.cell.trainer_messages): every request and reply survives the pipe as it
is, each request type has exactly one handler on the ranks, and what has none is refused clearly
on both sides."""

from __future__ import annotations

import dataclasses
import pickle
from multiprocessing.connection import Pipe

import pytest

from gyre.config import TrainConfig
from gyre.cell import trainer_messages as m
from gyre.cell.trainer_rank import MERGE, Rank, combine, dispatch
from gyre.cell.trainer_process import TrainerProcess

REQUESTS = [
    m.Start(cfg=dataclasses.asdict(TrainConfig()), model_dir="/models/tiny", seed=3, offloaded=True,
            checkpoint="/ck/step-2"),
    m.ForwardBackward(wire_mb={"input_ids": b"\x01\x02", "shape": (1, 2)}, step=4),
    m.Stash(step=4), m.ReduceGrads(step=4, members=(0, 2), attempt=1), m.Apply(step=4), m.Offload(), m.Restore(),
    m.SaveCheckpoint(path="/ck"), m.LoadCheckpoint(path="/ck"), m.ExportWeights(out_dir="/w", version=5),
    m.Hostnames(), m.Close(),
]
REPLIES = [
    m.Started(num_grad_elements=10, ranks=2), m.Stashed(held=True),
    m.GradsReduced(form_ms=1.5, cached=False, wait_ms=0.2, grad_norm_total=3.0),
    m.Applied(step=5, grad_norm=2.5, stats={"loss": 0.1, "step": 5}),
    m.Reply(value=m.Stashed(held=False), step=4), m.Reply(error="RuntimeError: no", step=None),
]


@pytest.mark.parametrize("msg", REQUESTS + REPLIES, ids=lambda x: type(x).__name__)
def test_each_message_round_trips_over_the_pipe(msg):
    assert pickle.loads(pickle.dumps(msg)) == msg
    a, b = Pipe()
    a.send(msg)
    got = b.recv()
    assert got == msg and type(got) is type(msg)


def test_every_request_has_one_handler_on_the_ranks():
    requests = {c for c in vars(m).values() if isinstance(c, type) and issubclass(c, m.Request) and c is not m.Request}
    # Start builds the rank and Close ends its loop: neither is dispatched
    assert set(Rank.HANDLERS) == requests - {m.Start, m.Close}
    assert set(MERGE) <= set(Rank.HANDLERS)
    names = [c.name for c in requests]
    assert len(set(names)) == len(names)  # what errors call each request


class _Fake:
    def stash(self, req):
        return m.Stashed(held=req.step > 0)

    def boom(self, req):
        raise RuntimeError("no gradients")


def test_dispatch_by_type_and_unknown_types_refused():
    table = {m.Stash: _Fake.stash, m.Apply: _Fake.boom}
    assert dispatch(table, _Fake(), m.Stash(2)) == m.Reply(value=m.Stashed(held=True))
    err = dispatch(table, _Fake(), m.Apply(2))
    assert not err.ok and err.error.startswith("RuntimeError: no gradients")
    for bad in (m.Offload(), ("stash", (2,)), "stash"):  # no handler; the old (method, args) tuple
        r = dispatch(table, _Fake(), bad)
        assert not r.ok and r.error.startswith("TypeError: unknown trainer request") and "Apply, Stash" in r.error


def test_rank_zero_combines_the_cells_answer():
    red = [m.Reply(value=m.GradsReduced(form_ms=f, cached=c, wait_ms=0.0, grad_norm_total=1.0))
           for f, c in ((2.0, True), (5.0, False))]
    assert combine(m.ReduceGrads(0, (0,), 1), red).value == m.GradsReduced(form_ms=5.0, cached=False, wait_ms=0.0,
                                                                  grad_norm_total=1.0)
    assert combine(m.Hostnames(), [m.Reply(value="a"), m.Reply(value="b")]).value == ["a", "b"]
    assert combine(m.Apply(0), [m.Reply(value=1), m.Reply(value=2)]).value == 1  # rank 0's own
    bad = combine(m.Stash(0), [m.Reply(value=None), m.Reply(error="boom")])
    assert bad.error == "rank 1: boom"


def test_the_parent_side_sends_only_requests(tmp_path):
    tp = TrainerProcess.__new__(TrainerProcess)  # no ranks: the check comes before any I/O
    for bad in (("stash", (0,)), m.Close(), m.Start(cfg={}, model_dir=""), m.Stashed(held=True)):
        with pytest.raises(TypeError, match="not a trainer request"):
            tp.request(bad)

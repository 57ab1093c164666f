"""Each service of the head on its own (gyre/services): the cell fleet over a link the test
answers, training dispatch's reduce protocol and requeueing, the ledger's lines, state and resume
reconciliation, and the rollout service's durable record and proxy start-up."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

from gyre.batch import expanded_batch, from_wire, to_wire
from gyre.config import GyreConfig, TrainConfig, load_config
from gyre.events import CellRoleChanged, ExecutionDropped, MicroBatchDone
from gyre.sched.core import Coordinator, CoreSpec
from gyre.sched.protocol import (Event, PrepareReduce, PrepareReduceReply, PushWeights, Reduce, ReduceReply, ToTrain,
                                 Train, TrainReply, reply_for)
from gyre.sched.state import Role
from gyre.services.fleet import CellFleet, StartError, WeightPaths
from gyre.services.ledger import Ledger
from gyre.services.rollout import RolloutService
from gyre.services.training import StepReduced, TrainingDispatch
from gyre.traj.store import iter_executions
from support.replay_head import IDENTITY
from support.service_records import record


class Link:
    """Answers each command with ``answer(cell, cmd)`` (None: never answers), through the fleet's
    own on_message, on the next turn of the event loop, as the MPI link's thread does."""

    def __init__(self, answer):
        self.answer, self.sent, self.fleet = answer, [], None

    def send_command(self, cell: int, cmd) -> None:
        self.sent.append((cell, cmd))
        rep = self.answer(cell, cmd)
        if rep is not None:
            asyncio.get_running_loop().call_soon(self.fleet.on_message, rep)


def fleet_with(answer, n=2, clock=lambda: 100.0):
    told = []
    link = Link(answer)
    fleet = CellFleet(link, n, emit=told.append, clock=clock)
    link.fleet = fleet
    fleet.paths = WeightPaths(Path("/m"), Path("/w"), Path("/c"))
    return fleet, link, told


def ok(cell, cmd):
    return reply_for(cmd, cell)


def test_fleet_commands_carry_the_paths_and_a_silent_cell_times_out_as_a_failed_reply():
    fleet, link, _ = fleet_with(lambda cell, cmd: None if cell == 1 else ok(cell, cmd))

    async def go():
        a = await fleet.to_train(fleet[0], 3)
        b = await fleet.push(fleet[0], 0)
        c = await fleet.call(fleet[1], PushWeights(version=2, weights="/w/v2"), timeout=0.05)
        return a, b, c

    a, b, c = asyncio.run(go())
    assert a.ok and b.ok and not c.ok and "no reply within" in c.error
    sent = [cmd for _, cmd in link.sent]
    assert isinstance(sent[0], ToTrain) and sent[0].checkpoint == "/c/v3"
    assert isinstance(sent[1], PushWeights) and sent[1].weights == "/m"  # version 0 is the model itself
    assert not fleet._futures  # a timed-out command leaves nothing waiting


def test_fleet_hello_restart_fatal_and_silence():
    now = [0.0]
    restarted = []
    fleet, _, told = fleet_with(ok, clock=lambda: now[0])
    fleet.on_engine_restarted = lambda cell, old: restarted.append((cell.id, old))

    async def go():
        fleet.on_message(Event(0, "hello", {"engine_url": "http://a", "hostname": "n0"}))
        assert not fleet._hello.is_set()  # one cell has not said hello yet
        fleet.on_message(Event(1, "hello", {"engine_url": "http://b"}))
        await fleet.wait_hello(1)

    asyncio.run(go())
    fleet.on_message(Event(0, "engine_restarted", {"engine_url": "http://a2"}))
    assert restarted == [(0, "http://a")] and fleet.urls_of(fleet[0]) == {"http://a", "http://a2"}
    fleet.on_message(Event(1, "fatal", {"why": "oom"}))
    assert fleet[1].role is Role.FAILED and told == [CellRoleChanged(0.0, 1, "failed")]
    now[0] = 50.0
    assert fleet.check_heartbeats(now[0], 30.0) == [fleet[0]]  # cell 1 is failed already
    assert fleet[0].role is Role.FAILED and any("silent for 50 s" in e for e in fleet.errors)
    assert [e["kind"] for e in fleet.events] == ["engine_restarted", "fatal"]


def test_fleet_waits_for_hello_with_a_message_naming_the_silent_cells():
    fleet, _, _ = fleet_with(ok)
    fleet.on_message(Event(0, "hello", {"engine_url": "http://a"}))
    with pytest.raises(RuntimeError, match="cell 1"):
        asyncio.run(fleet.wait_hello(0.05))


def test_a_stop_while_waiting_for_hello_ends_the_wait_at_once_saying_why():
    """A SIGTERM (scancel, Slurm ending a job whose step failed) or Ctrl-C while the cells start:
    the head stops waiting then, not after the start-up wait's 300 s (before: under Slurm the job
    sat until KillWait's SIGKILL). Nothing here waits on time: the 300 s bound would fail the test."""
    fleet, _, _ = fleet_with(ok)
    fleet.on_message(Event(0, "hello", {"engine_url": "http://a"}))  # cell 1 never says hello

    async def go():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_soon(stop.set)
        await asyncio.wait_for(fleet.wait_hello(300.0, stop=stop, why_stopped=lambda: "stopped by a signal"), 60)

    with pytest.raises(StartError, match="stopped by a signal while waiting for the cells to start"):
        asyncio.run(go())
    # the cells' hellos still end the wait as before, with or without a stop event
    fleet.on_message(Event(1, "hello", {"engine_url": "http://b"}))
    asyncio.run(fleet.wait_hello(0.05, stop=asyncio.Event()))


def step_core(mbs=3, **spec):
    """A core whose one step (a group of 2 executions) is full with ``mbs`` micro-batches;
    ``spec``: further CoreSpec fields (e.g. minibatches=2, prox=True)."""
    core = Coordinator(CoreSpec(steps=1, groups_per_step=1, group_size=2, **spec))
    (g,) = core.start_groups(1, 0.0)
    for m in range(2):
        core.execution_started(g.id, f"e{m}", 0.0)
    for m in range(2):
        core.execution_evaluated(f"e{m}", 1.0, version=0, tokens=10.0)
    core.microbatches_added(g.id, {i: 1.0 for i in range(mbs)})
    return core


def dispatch_with(answer, core):
    fleet, link, told = fleet_with(answer)
    notices = []
    td = TrainingDispatch(GyreConfig(), fleet, emit=told.append, clock=lambda: 5.0,
                          spawn=lambda coro: asyncio.get_running_loop().create_task(coro),
                          notice=lambda kind, info: notices.append((kind, info)))
    td.core = core
    td.batches = {i: {"mb": i} for i in range(3)}
    for c in fleet:
        fleet.set_role(c, Role.TRAIN, 0.0)
    return td, fleet, link, told, notices


def test_dispatch_hands_work_to_idle_train_cells_and_a_dying_trainer_requeues_what_it_held():
    core = step_core()
    # cell 0's trainer dies on its second micro-batch, reporting its first as lost too
    seen = {0: 0}

    def answer(cell, cmd):
        if isinstance(cmd, Train) and cell == 0:
            seen[0] += 1
            if seen[0] == 2:
                return TrainReply(seq=cmd.seq, cell=cell, ok=False, lost=[first[0]])
            first.append(cmd.mb_id)
        return TrainReply(seq=cmd.seq, cell=cell, mb_id=getattr(cmd, "mb_id", None), stats={"loss": 1.0})

    first: list[int] = []
    td, fleet, link, told, _ = dispatch_with(answer, core)

    async def go():
        for _ in range(20):
            td.dispatch()
            await asyncio.sleep(0)
            if core.step_ready():
                return

    asyncio.run(go())
    assert core.step_ready()
    trained = [e for e in told if isinstance(e, MicroBatchDone)]
    assert sum(not e.ok for e in trained) == 1
    # every micro-batch is held by exactly one cell at the end: the lost one was trained again
    held = [m for c in fleet for m in c.step_mbs]
    assert sorted(held) == [0, 1, 2]


def test_reduce_retries_when_nothing_was_applied_and_stops_when_replicas_may_disagree():
    core = step_core(mbs=2)
    mode = {"reduce": "ok"}

    def answer(cell, cmd):
        if isinstance(cmd, PrepareReduce):
            return PrepareReduceReply(seq=cmd.seq, cell=cell, mb_ids=[cell])
        if isinstance(cmd, Reduce):
            if mode["reduce"] == "retry" and cell == 1:
                return ReduceReply(seq=cmd.seq, cell=cell, ok=False, error="trainer died\ntrace", retry=True, lost=[1])
            if mode["reduce"] == "split" and cell == 1:
                return ReduceReply(seq=cmd.seq, cell=cell, ok=False, error="commit failed")
            return ReduceReply(seq=cmd.seq, cell=cell, grad_norm=0.5)
        return ok(cell, cmd)

    td, fleet, link, _, notices = dispatch_with(answer, core)
    for _ in range(2):  # both trained, one on each cell
        core.microbatch_trained(core.next_microbatch())
    fleet[0].step_mbs, fleet[1].step_mbs = {0}, {1}
    mode["reduce"] = "retry"
    assert asyncio.run(td.reduce(0)) is None
    assert notices == [("reduce_retry", {"step": 0, "why": ["cell 1: trainer died"]})]
    assert fleet[1].step_mbs == set() and core.step.queue == [1]  # handed out again
    core.microbatch_trained(core.next_microbatch())
    fleet[1].step_mbs = {1}
    mode["reduce"] = "split"
    assert asyncio.run(td.reduce(0)) == "step 0: reduce failed: cell 1: commit failed"
    mode["reduce"] = "ok"
    red = asyncio.run(td.reduce(0))
    assert isinstance(red, StepReduced) and red.grad_norm == 0.5 and [c.id for c in red.participants] == [0, 1]
    reduces = [cmd for _, cmd in link.sent if isinstance(cmd, Reduce)]
    assert reduces[-1].leader == 0 and reduces[-1].weights_dir == "/w/v1" and reduces[-1].checkpoint_dir == "/c/v1"


def test_reduce_waits_for_a_trainer():
    core = step_core()
    td, fleet, link, _, _ = dispatch_with(ok, core)
    for c in fleet:
        fleet.set_role(c, Role.ROLLOUT, 1.0)
    fleet[0].step_mbs = {0}  # it trained, then left for rollout: it still takes part, but cannot apply
    assert asyncio.run(td.reduce(0)) is None and link.sent == []


def test_a_step_with_two_minibatches_asks_pi_prox_first_then_reduces_once_per_update():
    # 4 micro-batches, 2 minibatches: parts [0, 1] and [2, 3]; pi_prox of 2 and 3 before update 0
    core = step_core(4, minibatches=2, prox=True)
    held: dict[int, list] = {0: [], 1: []}
    lost_once = []

    def answer(cell, cmd):
        if isinstance(cmd, Train):
            if cmd.prox:
                return TrainReply(seq=cmd.seq, cell=cell, mb_id=cmd.mb_id, logprobs=[-float(cmd.mb_id)] * 2)
            if cmd.update == 1 and not lost_once:  # a trainer dies between the updates, holding nothing of part 0
                lost_once.append(cmd.mb_id)
                return TrainReply(seq=cmd.seq, cell=cell, ok=False, lost=[0, 1, cmd.mb_id])
            held[cell].append(cmd.mb_id)
            return TrainReply(seq=cmd.seq, cell=cell, mb_id=cmd.mb_id, stats={"loss": 1.0})
        if isinstance(cmd, PrepareReduce):
            return PrepareReduceReply(seq=cmd.seq, cell=cell, mb_ids=list(held[cell]))
        if isinstance(cmd, Reduce):
            held[cell].clear()
            return ReduceReply(seq=cmd.seq, cell=cell, grad_norm=0.5 + cmd.update)
        return ok(cell, cmd)

    td, fleet, link, told, _ = dispatch_with(answer, core)
    td.batches = {i: {"mb": i, "weights": np.ones(2, np.float32)} for i in range(4)}

    async def train_update():
        for _ in range(50):
            td.dispatch()
            await asyncio.sleep(0)
            if core.step_ready():
                return
        raise AssertionError(f"the update never got ready: {core.step}")

    async def go():
        await train_update()
        core.step_ending(2.0)
        red = await td.reduce(0)
        assert isinstance(red, StepReduced) and not red.final
        td.update_applied(red)
        await train_update()
        core.step_ending(3.0)
        return await td.reduce(0)

    red = asyncio.run(go())
    trains = [cmd for _, cmd in link.sent if isinstance(cmd, Train)]
    prox = [c.mb_id for c in trains if c.prox]
    assert sorted(prox) == [2, 3] and all(c.update == 0 for c in trains if c.prox)
    first = trains.index(next(c for c in trains if c.update == 1))
    assert sorted(c.mb_id for c in trains[:first] if not c.prox) == [0, 1]  # part 0, then part 1
    later = [c for c in trains if c.update == 1]
    assert {c.mb_id for c in later} == {2, 3} and len(later) == 3  # the one lost was trained again, alone
    for c in later:  # each carries its own pi_prox from the step's start
        assert list(c.batch["prox_logprobs"]) == [-float(c.mb_id)] * 2
    assert all("prox_logprobs" not in c.batch for c in trains if c.update == 0)
    reduces = [cmd for _, cmd in link.sent if isinstance(cmd, Reduce)]
    assert [(r.update, r.final, r.checkpoint_dir) for r in reduces] == \
        [(0, False, "/c/v0u1"), (0, False, "/c/v0u1"), (1, True, "/c/v1"), (1, True, "/c/v1")]
    assert isinstance(red, StepReduced) and red.final and red.grad_norms == [0.5, 1.5]
    assert core.step.update == 1 and core.step_ready() is False  # reducing: the driver ends the step
    assert sorted(core.step_ended(4.0).microbatches) == [0, 1, 2, 3]


def _toy_step(trainer, n_mbs=4):
    """Micro-batches of unequal size and weight, behaviour log-probs off the trainer's own."""
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(n_mbs):
        seqs = [[1, 2, 3] + torch.randint(10, 90, (n,), generator=g).tolist() for n in (4 + k, 6)]
        mb = expanded_batch(seqs, [3, 3], old_logprobs=[[0.0] * (4 + k), [0.0] * 6], advantages=[1.0, -0.5 * k],
                            execution_index=[2 * k, 2 * k + 1], weights=torch.full((10 + k,), 0.01 * (k + 1)))
        mb.old_logprobs = trainer.logprobs(mb) + 0.3 * torch.randn(mb.num_targets, generator=g)
        out.append(mb)
    return out


@pytest.mark.slow  # three tiny trainers: ~20 s on a loaded 2-core machine
def test_live_minibatches_train_exactly_as_the_offline_trainer():
    """Two cells whose trainers are real (in this process) run a step of 4 micro-batches as 2
    updates through training dispatch; the offline trainer's `train_step` on the same micro-batches
    ends with the same weights and the same loss, and the clip against pi_prox acts."""
    from gyre.train.toy import random_qwen2
    from gyre.train.trainer import EmbeddedTrainer

    cfg = load_config(None, ["train.minibatches_per_step=2", "train.off_policy=decoupled", "train.lr=0.2",
                             "train.dtype=float32"])
    tcfg = TrainConfig(off_policy="decoupled", lr=0.2, adam_eps=1.0, dtype="float32")
    cells = [EmbeddedTrainer(tcfg, random_qwen2(seed=0, std=0.1)) for _ in range(2)]
    offline = EmbeddedTrainer(tcfg, random_qwen2(seed=0, std=0.1))
    mbs = _toy_step(offline)
    core = step_core(len(mbs), minibatches=2, prox=True)
    held: dict[int, list] = {0: [], 1: []}
    reduced: dict[tuple, torch.Tensor] = {}

    def answer(cell, cmd):
        t = cells[cell]
        if isinstance(cmd, Train):
            if cmd.prox:
                return TrainReply(seq=cmd.seq, cell=cell, mb_id=cmd.mb_id,
                                  logprobs=t.logprobs(from_wire(cmd.batch)).tolist())
            held[cell].append(cmd.mb_id)
            return TrainReply(seq=cmd.seq, cell=cell, mb_id=cmd.mb_id, stats=t.forward_backward(from_wire(cmd.batch)))
        if isinstance(cmd, PrepareReduce):
            return PrepareReduceReply(seq=cmd.seq, cell=cell, mb_ids=list(held[cell]))
        if isinstance(cmd, Reduce):  # the sum over both cells, taken before either applies
            total = reduced.setdefault((cmd.step, cmd.update), sum(c.flat_grads() for c in cells))
            held[cell].clear()
            t.clear_gradients()
            t.set_flat_grads(total)
            return ReduceReply(seq=cmd.seq, cell=cell, grad_norm=t.apply_gradients(final=cmd.final)["grad_norm"])
        return ok(cell, cmd)

    fleet, link, told = fleet_with(answer)
    td = TrainingDispatch(cfg, fleet, emit=told.append, clock=lambda: 5.0,
                          spawn=lambda coro: asyncio.get_running_loop().create_task(coro))
    td.core = core
    td.batches = {i: to_wire(mb) for i, mb in enumerate(mbs)}
    for c in fleet:
        fleet.set_role(c, Role.TRAIN, 0.0)

    async def go():
        while True:
            for _ in range(200):
                td.dispatch()
                await asyncio.sleep(0)
                if core.step_ready():
                    break
            core.step_ending(1.0)
            red = await td.reduce(0)
            if red.final:
                return red
            td.update_applied(red)

    red = asyncio.run(go())
    want = offline.train_step(mbs, 2)
    assert len(red.grad_norms) == want["minibatches"] == 2
    assert red.grad_norms == pytest.approx(want["minibatch_grad_norms"], rel=1e-4)
    for t in cells:  # two updates, one step counted
        assert (t.step, t.update) == (1, 0)
        for a, b in zip(t.model.parameters(), offline.model.parameters()):
            assert torch.allclose(a, b, atol=1e-6)
    stats = [e.stats for e in told if isinstance(e, MicroBatchDone)]
    assert len(stats) == 4 and all(e.ok for e in told if isinstance(e, MicroBatchDone))
    assert sum(s["loss"] for s in stats) == pytest.approx(want["loss"], rel=1e-5)
    assert want["clip_frac"] > 0 and max(s["clip_frac"] for s in stats) > 0  # the clip acted
    # pi_prox of the second part came from the step's start: moved from the updated policy
    assert max(s["prox_drift_max"] for s in stats) > 1e-3


class Group:  # the fields of a core GroupRecord the ledger reads
    def __init__(self, gid, executions=(), state="waiting"):
        self.id, self.version, self.sync, self.lag_syncs = gid, 0, 0, 0
        self.executions = {e: None for e in executions}
        self.state = type("S", (), {"value": state})()


def test_ledger_lines_are_each_execution_s_last_word(tmp_path):
    told = []
    led = Ledger(tmp_path, tmp_path / "shards", emit=told.append, clock=lambda: 7.0)
    led.open()
    led.group_started(0, "t")
    led.execution_ended("a", 1.0, "")
    led.execution_ended("b", None, "status failed", unscorable="",
                        error="harness.max_workspace_files = 10 passed: the workspace holds more than 10 entries")
    led.line("a", Group(0), admitted=True, staleness=0, step=0)
    led.close_unfinished([Group(0, ["a", "b"])], "run stopped", 1)
    led.close()
    rows = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [(r["execution"], r["admitted"], r["reward"]) for r in rows] == [("a", True, 1.0), ("b", False, None)]
    assert rows[1]["reason"] == "run stopped before step 1 closed (group waiting)"
    assert rows[0]["error"] is None and rows[1]["error"].startswith("harness.max_workspace_files = 10 passed")
    assert told == [ExecutionDropped(7.0, "b", 0, rows[1]["reason"])] and led.ended == {}
    assert led.unscorable == {"no reward": 1}


def test_ledger_resume_rolls_back_an_uncommitted_step_and_accounts_for_everything(tmp_path):
    cfg = GyreConfig()
    svc = RolloutService(cfg, None, tmp_path, IDENTITY, tmp_path / "shards")
    svc.record([record("q0-t-g0", 0), record("q0-t-g1", 0), record("q1-t-g0", 1, status="stopped", calls=2)])
    (tmp_path / "workspaces" / "q1-t-g1").mkdir(parents=True)  # running when the head died
    led = Ledger(tmp_path, tmp_path / "shards", emit=lambda e: None)
    led.open()
    led.group_started(0, "t")
    for eid in ("q0-t-g0", "q0-t-g1"):
        led.execution_ended(eid, 1.0, "")
        led.line(eid, Group(0), admitted=True, staleness=0, step=1)  # step 1 never committed
    led.step_row({"step": 0})
    led.step_row({"step": 1})
    led.write_state(version=1, rollout_version=1, groups_started=2, weights="/w/v1", checkpoint="/c/v1")
    led.close()
    assert led.load_state() == (1, 2)
    rows = {r["execution"]: r for r in map(json.loads, (tmp_path / "ledger.jsonl").read_text().splitlines())}
    assert not rows["q0-t-g0"]["admitted"] and "step 1 rolled back" in rows["q0-t-g0"]["reason"]
    assert not rows["q1-t-g0"]["admitted"] and rows["q1-t-g1"]["reason"].startswith("lost")
    assert [json.loads(x)["step"] for x in (tmp_path / "steps.jsonl").read_text().splitlines()] == [0]
    replays = led.stopped_to_replay()
    assert list(replays) == [("t", 0)] and replays[("t", 0)][0][0] == "q1-t-g0"
    led.open()
    led.resuming("q2-t-g0", "q1-t-g0")  # taken: never replayed into a second execution
    led.close()
    assert led.stopped_to_replay() == {}


def test_rollout_service_records_durably_and_serves_the_proxy(tmp_path):
    from gyre.config import default_tiny_dir
    from gyre.model.identity import model_identity
    from gyre.model.tiny import ensure_tiny_model
    from gyre.harness.sandbox import Environments, SandboxConfig

    cfg = GyreConfig()
    cfg.run.dir, cfg.proxy.port = str(tmp_path), 0
    model_dir = ensure_tiny_model(default_tiny_dir(cfg))
    svc = RolloutService(cfg, Environments(SandboxConfig.from_config(cfg.harness)), model_dir,
                         model_identity(model_dir), tmp_path / "shards")
    svc.record([record("q0-t-g0", 0)])  # durable when it returns: readable by anyone now
    assert [r.execution_id for r in iter_executions(tmp_path / "shards")] == ["q0-t-g0"]

    async def go():
        await svc.start([], engine_key="k", wait_for_endpoint_s=0.1)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(svc.base_url + "/models") as r:
                    status = r.status  # no execution key: refused, by the proxy that serves
            assert svc.broken is None
            svc.add_endpoint("http://127.0.0.1:9")
            await svc.remove_endpoint("http://127.0.0.1:9")
            return status
        finally:
            await svc.close()

    assert asyncio.run(go()) == 401
    svc.record([record("q0-t-g1", 0)])
    svc.compact()
    assert sorted(r.execution_id for r in iter_executions(tmp_path / "shards")) == ["q0-t-g0", "q0-t-g1"]


def test_a_killed_heads_journals_are_resumed_by_replay_once_and_never_for_a_recorded_execution(tmp_path):
    """Issue 34: an execution running when the head was SIGKILLed left only its journal; resume
    replays it (member for member); a journal whose execution reached a shard is not replayed."""
    from gyre.proxy.journal import Journal
    from gyre.proxy.replay import Replay

    svc = RolloutService(GyreConfig(), None, tmp_path, IDENTITY, tmp_path / "shards")
    svc.record([record("q0-t-g0", 0)])
    journal = Journal(tmp_path / "journal")
    journal.append("q0-t-g0", [1, 2], [3], [-0.5], "stop", "0")  # killed between its shard and its discard
    for k in range(3):
        journal.append("q0-t-g1", [1, 2, k], [7, k], [-0.25, -0.5], "stop", "0")
    journal.close()
    with open(tmp_path / "journal" / "q0-t-g1.jsonl", "a") as f:
        f.write('{"input": "cut sh')  # the line being written when the head died
    led = Ledger(tmp_path, tmp_path / "shards", emit=lambda e: None)
    replays = led.stopped_to_replay(tmp_path / "journal")
    assert list(replays) == [("t", 1)]
    (source, replay), = replays[("t", 1)]
    assert source == "q0-t-g1" and isinstance(replay, Replay) and replay.recorded == 3
    hit = replay.match([1, 2, 1])
    assert hit.output_ids == [7, 1] and hit.logprobs == [-0.25, -0.5]
    led.open()
    led.resuming("q1-t-g1", "q0-t-g1")  # taken: never replayed into a second execution
    led.close()
    assert led.stopped_to_replay(tmp_path / "journal") == {}

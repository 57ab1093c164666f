"""Head memory over a 40-step toy run (part of benchmarks/bench_online.py, whose online.json gets the
figures): does a finished execution leave the head once its shard is durable?

A real `gyre run` of 40 steps takes hours on a small shared machine, so this drives the head's own
handlers (coordinator core, ledger, HDF5 shards, selection and materializer, events and statistics:
everything the head keeps in memory) with toy executions; only the cell agents and harness
processes are absent (their replies are played). Each execution has a tree of 8 calls x ~2k tokens.
RSS (VmRSS of the process, after a garbage collection) is read after step 5 and after step 40;
each variant runs in a fresh process.

    python benchmarks/bench_online.py --rss-only   # refreshes these keys of benchmarks/results/online.json

Keys (`measure()`): head_rss_mb_step5, head_rss_mb_step40, head_rss_growth (goal < 0.10), and the same run with
the records kept for the whole run as before this change (head_rss_mb_step40_records_kept).
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gyre.config import GyreConfig  # noqa: E402
from gyre.head import Head  # noqa: E402
from gyre.sched.core import Coordinator, CoreSpec  # noqa: E402
from gyre.sched.protocol import ReduceReply, TrainReply  # noqa: E402
from gyre.sched.state import Role  # noqa: E402
from gyre.services.fleet import WeightPaths  # noqa: E402
from gyre.services.rollout import RolloutService  # noqa: E402
from gyre.services.training import StepReduced  # noqa: E402
from gyre.traj.record import ExecutionRecord  # noqa: E402
from gyre.traj.select import SelectionSpec  # noqa: E402
from gyre.traj.tree import Segment, TrajectoryTree  # noqa: E402

STEPS, Q, G, CALLS, TOKENS = 40, 4, 4, 8, 2048


def rss_mb() -> float:
    gc.collect()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def toy_record(eid: str, gid: int, member: int, version: int, endpoint: str, t: float):
    rng = np.random.default_rng(hash(eid) % 2**32)
    tree, prompt = TrajectoryTree(), [int(x) for x in rng.integers(10, 500, 64)]
    for k in range(CALLS):  # each call extends the conversation: a chain of ~TOKENS/CALLS new tokens
        out = [int(x) for x in rng.integers(10, 500, TOKENS // CALLS)]
        tree.add_call([Segment("task", prompt, "user")], f"c{k}", prompt, out, [-0.5] * len(out),
                      agent_role="main", policy_version=version, endpoint=endpoint, t_start=t + k, t_end=t + k + 0.5)
        prompt = prompt + out
    return ExecutionRecord(eid, "task", gid, "done", float(member % 2), "tests", tree=tree)


def run(keep_records: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="gyre-rss-"))
    cfg = GyreConfig()
    cfg.run.dir, cfg.run.steps, cfg.run.groups_per_step, cfg.harness.group_size = str(tmp), STEPS, Q, G
    cfg.store.executions_per_shard = 8
    # the real head, core, ledger, shards and materializer; no cells or harness (the bench plays them)
    head = Head(cfg, None, 2)
    head.attach(Coordinator(CoreSpec(steps=STEPS, groups_per_step=Q, group_size=G)), [SimpleNamespace(name="task")],
                WeightPaths(tmp, tmp, tmp), SelectionSpec.from_config(cfg.selection),
                RolloutService(cfg, None, tmp, {"model_hash": "m" * 8, "tokenizer_hash": "t" * 8}, tmp / "shards"))
    head.ledger.open()
    head._spawn = lambda coro: coro.close()
    if keep_records:  # the head before this change: every record stays for the whole run
        head.training.release = lambda eids: None
    rollout, trainer = head.cells
    rollout.engine_url, trainer.engine_url = "http://e0", "http://e1"
    head.fleet.set_role(trainer, Role.TRAIN, 0.0)

    async def train(cell, step, mid, batch, update=0):
        return TrainReply(seq=0, cell=cell.id, stats={"loss": 1e-5})

    head.fleet.train = train
    out, now = {}, 0.0
    for step in range(STEPS):
        for g in head.start_groups(Q, now):
            for m in range(G):
                eid = f"q{g.id}-task-g{m}"
                rec = toy_record(eid, g.id, m, head.core.rollout_version, rollout.engine_url, now)
                head.rollout.settle(rec, lambda r, eid=eid: head.execution_scored(eid, r, now + 10))
                head.execution_recorded(eid, rec, now + 10)
        while (mb := head.core.next_microbatch()) is not None:
            asyncio.run(head.training.train(trainer, mb))
        now += 20
        head.core.step_ending(now)
        res = head.step_ended(now)
        head.step_committed(res, StepReduced([trainer], [ReduceReply(seq=0, cell=trainer.id, grad_norm=0.1)], 0.0), 0.0)
        if step + 1 in (5, STEPS):
            out[f"step{step + 1}"] = rss_mb()
            out[f"records_step{step + 1}"] = len(head.training.records)
    assert head.core.done and len(head.stats.steps) == STEPS
    return out


def measure() -> dict:
    """Both variants, each in a fresh process (RSS is the process's), as online.json's keys."""
    res = {}
    for variant in ("--freed", "--kept"):
        p = subprocess.run([sys.executable, __file__, variant], capture_output=True, text=True, check=True)
        res[variant] = json.loads(p.stdout.strip().splitlines()[-1])
    f, k = res["--freed"], res["--kept"]
    return {"head_rss_mb_step5": round(f["step5"], 1), "head_rss_mb_step40": round(f["step40"], 1),
            "head_rss_growth": round(f["step40"] / f["step5"] - 1, 4),
            "head_rss_goal_growth": 0.10,
            "head_rss_steps": STEPS, "head_rss_executions_per_step": Q * G,
            "head_rss_tokens_per_execution": TOKENS + 64,
            "head_rss_records_in_memory_step40": f["records_step40"],
            "head_rss_mb_step5_records_kept": round(k["step5"], 1),
            "head_rss_mb_step40_records_kept": round(k["step40"], 1),
            "head_rss_records_in_memory_step40_records_kept": k["records_step40"],
            "head_rss_method": "the head's handlers driven in-process with toy executions (no cell agents or "
                               "harnesses; benchmarks/head_memory.py); VmRSS after gc, each variant in a fresh "
                               "process; records_kept: the head before records were released"}


if __name__ == "__main__":  # one variant, in this fresh process (measure() starts it)
    print(json.dumps(run(keep_records=sys.argv[1] == "--kept")))

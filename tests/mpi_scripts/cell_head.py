"""A small test head (rank 0) driving real cell agents (ranks 1-2) through the control protocol.

    mpiexec -n 3 python tests/mpi_scripts/cell_head.py RUN_DIR MODEL_DIR KEY_FILE OUT_JSON

Rank 0 runs the scenario of tests/cell/test_cell_agent.py and writes what it observed to OUT_JSON
(the test asserts on it); the other ranks run `gyre.cell.main.main`. The head always
sends `stop` at the end, even when a check fails, so that every rank exits.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

SWITCHES = 6
TRAIN_OVERRIDES = ["train.dtype=float32", "train.lr=1e-3", "train.adam_eps=1.0"]  # Slurm: a rank per node
# rows of the toy step: (sequence, prompt length, advantage); one execution per row
ROWS = [([1, 2, 3, 40, 41, 42, 43], 3, 1.0), ([1, 2, 3, 50, 51], 3, -1.0),
        ([9, 8, 60, 61, 62, 63, 64, 65], 2, 0.5), ([9, 8, 70], 2, -0.5)]


def micro_batch(rows: list[int], num_executions: int):
    import torch

    from gyre.batch import expanded_batch, per_execution_weights

    seqs = [ROWS[r][0] for r in rows]
    plens = [ROWS[r][1] for r in rows]
    exe = torch.tensor([r for r in rows for _ in range(len(ROWS[r][0]) - ROWS[r][1])])
    return expanded_batch(seqs, plens, old_logprobs=[[-4.0] * (len(s) - p) for s, p in zip(seqs, plens)],
                          advantages=[ROWS[r][2] for r in rows], execution_index=list(rows),
                          weights=per_execution_weights(exe, num_executions))


class Head:
    def __init__(self, comm, key: str, out: dict) -> None:
        from gyre.cell.mpi_link import HeadLink

        self.key, self.out = key, out
        self.inbox: queue.Queue = queue.Queue()
        self.events: list = []
        self.replies: dict = {}
        self.link = HeadLink(comm, self.inbox.put).start()
        self.cells = self.link.cells

    # --- messages -------------------------------------------------------------------------
    def _pump(self, timeout_s: float) -> None:
        from gyre.sched.protocol import Reply

        try:
            msg = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return
        if isinstance(msg, Reply):
            self.replies[msg.seq] = msg
        else:
            self.events.append(msg)

    def send(self, cell: int, kind: str, **args):
        from gyre.sched.protocol import COMMANDS

        cmd = COMMANDS[kind](**args)
        self.link.send_command(cell, cmd)
        return cmd.seq, time.perf_counter()

    def wait(self, seq: int, timeout_s: float = 120.0):
        deadline = time.monotonic() + timeout_s
        while seq not in self.replies:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply to command {seq} within {timeout_s} s")
            self._pump(0.05)
        return self.replies.pop(seq)

    def call(self, cell: int, kind: str, timeout_s: float = 120.0, **args):
        seq, t0 = self.send(cell, kind, **args)
        reply = self.wait(seq, timeout_s)
        reply.rtt_s = time.perf_counter() - t0
        return reply

    def call_all(self, cells, kind: str, **args) -> list:
        sent = [self.send(c, kind, **args) for c in cells]
        return [self.wait(seq) for seq, _ in sent]

    def event(self, kind: str, cell: int, timeout_s: float = 60.0, after: int = 0):
        """The first event of `kind` from `cell` among events[after:]."""
        deadline = time.monotonic() + timeout_s
        while True:
            for e in self.events[after:]:
                if e.kind == kind and e.cell == cell:
                    return e
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind} event from cell {cell} within {timeout_s} s")
            self._pump(0.05)

    # --- engine HTTP ----------------------------------------------------------------------
    def http(self, url: str, path: str, body: dict | None = None, key: bool = True) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {self.key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def generate(self, url: str) -> int:
        return self.http(url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})[0]

    def weight_version(self, url: str) -> str:
        return self.http(url, "/model_info")[1].get("weight_version")


def reply_dict(r) -> dict:
    return {"ok": r.ok, "error": r.error, "phases": r.phases, "info": {**r.info, "rtt_s": getattr(r, "rtt_s", None)}}


def max_diff(weights_dir: Path, state: dict) -> float:
    from gyre.train.export import load_hf_dir

    got = load_hf_dir(weights_dir)[1]  # one piece per trainer rank of the leader cell
    assert got.keys() == state.keys(), (sorted(got), sorted(state))
    return max(float((got[k] - state[k]).abs().max()) for k in state)


def scenario(h: Head, run: Path, model: Path, out: dict) -> None:
    import torch

    from gyre.config import load_config
    from gyre.batch import to_wire
    from gyre.train.backends import make_trainer

    torch.set_num_threads(1)
    c = out["checks"]
    hello = {e.cell: e.info for e in (h.event("hello", cell, 400) for cell in range(h.cells))}
    urls = {cell: info["engine_url"] for cell, info in hello.items()}
    out["hello"] = hello
    c["hello_generate"] = [h.generate(urls[i]) for i in range(2)]
    c["health_without_key"] = h.http(urls[0], "/health", key=False)[0]

    # the reference: one trainer doing a whole step's micro-batches
    ref = make_trainer(load_config(None, TRAIN_OVERRIDES).train, model)
    a, b, cc = micro_batch([0, 1], 4), micro_batch([2, 3], 4), micro_batch([0, 1, 2, 3], 4)

    # rollout -> train
    r = h.call_all([0, 1], "to_train", version=0, checkpoint=None)
    out["to_train_1"] = [reply_dict(x) for x in r]
    c["generate_after_to_train"] = [h.generate(urls[i]) for i in range(2)]

    # step 0 over both cells
    r = [h.call(0, "train", step=0, mb_id=0, batch=to_wire(a)), h.call(1, "train", step=0, mb_id=1, batch=to_wire(b))]
    out["train_step0"] = [reply_dict(x) for x in r]
    out["prepare_step0"] = [reply_dict(x) for x in h.call_all([0, 1], "prepare_reduce", step=0)]
    r = h.call_all([0, 1], "reduce", step=0, participants=[0, 1], leader=0,
                   weights_dir=str(run / "weights" / "v1"), checkpoint_dir=str(run / "checkpoints" / "v1"))
    out["reduce_step0"] = [reply_dict(x) for x in r]
    ref.forward_backward(a)
    ref.forward_backward(b)
    out["ref_grad_norm_1"] = ref.optimizer_step()["grad_norm"]
    c["v1_max_diff"] = max_diff(run / "weights" / "v1", ref.hf_state_dict())

    # step 1 on cell 1 alone, while cell 0 switches to rollout
    h.call(1, "train", step=1, mb_id=2, batch=to_wire(cc))
    out["prepare_step1"] = reply_dict(h.call(1, "prepare_reduce", step=1))
    seq_reduce, _ = h.send(1, "reduce", step=1, participants=[1], leader=1,
                           weights_dir=str(run / "weights" / "v2"), checkpoint_dir=str(run / "checkpoints" / "v2"))
    to_rollout_0 = h.call(0, "to_rollout", version=1, weights=str(run / "weights" / "v1"))
    out["reduce_step1"] = reply_dict(h.wait(seq_reduce))
    out["to_rollout_1"] = [reply_dict(to_rollout_0)]
    c["weight_version_cell0"] = h.weight_version(urls[0])
    ref.forward_backward(cc)
    out["ref_grad_norm_2"] = ref.optimizer_step()["grad_norm"]
    c["v2_max_diff"] = max_diff(run / "weights" / "v2", ref.hf_state_dict())
    r = h.call(1, "to_rollout", version=2, weights=str(run / "weights" / "v2"))
    out["to_rollout_1"].append(reply_dict(r))
    c["weight_version_cell1"] = h.weight_version(urls[1])
    c["generate_after_to_rollout"] = [h.generate(urls[i]) for i in range(2)]
    out["push_weights"] = reply_dict(h.call(0, "push_weights", version=2, weights=str(run / "weights" / "v2")))

    # fault: kill -9 of cell 0's engine
    mark = len(h.events)
    os.kill(hello[0]["engine_pid"], signal.SIGKILL)
    ev = h.event("engine_restarted", 0, 60, after=mark)
    out["engine_restarted"] = ev.info
    c["restarted_generate"] = h.generate(ev.info["engine_url"])
    c["restarted_weight_version"] = h.weight_version(ev.info["engine_url"])
    urls[0] = ev.info["engine_url"]

    # both to train at version 2 (cell 0 catches up from the checkpoint), then kill cell 1's trainer
    r = h.call_all([0, 1], "to_train", version=2, checkpoint=str(run / "checkpoints" / "v2"))
    out["to_train_2"] = [reply_dict(x) for x in r]
    out["train_before_kill"] = reply_dict(h.call(1, "train", step=2, mb_id=10, batch=to_wire(a)))
    mark = len(h.events)
    os.kill(r[1].info["trainer_pid"], signal.SIGKILL)
    out["train_after_kill"] = reply_dict(h.call(1, "train", step=2, mb_id=11, batch=to_wire(b)))
    out["trainer_restarted"] = h.event("trainer_restarted", 1, 60, after=mark).info
    prep = h.call(1, "prepare_reduce", step=2)
    out["prepare_after_kill"] = reply_dict(prep)
    # the head hands the lost micro-batches to cell 0 and completes the step over both cells
    lost = sorted(set(prep.info["lost"]) | set(out["train_after_kill"]["info"].get("lost", [])))
    for mb_id in lost:
        h.call(0, "train", step=2, mb_id=mb_id, batch=to_wire(a if mb_id == 10 else b))
    h.call_all([0, 1], "prepare_reduce", step=2)
    r = h.call_all([0, 1], "reduce", step=2, participants=[0, 1], leader=0,
                   weights_dir=str(run / "weights" / "v3"), checkpoint_dir=str(run / "checkpoints" / "v3"))
    out["reduce_step2"] = [reply_dict(x) for x in r]
    ref.forward_backward(a)
    ref.forward_backward(b)
    ref.optimizer_step()
    c["v3_max_diff"] = max_diff(run / "weights" / "v3", ref.hf_state_dict())

    # switch control path: round trips on one cell (the other idle), after the first
    # to_rollout has loaded v3, so no phase moves new weight bytes
    switches = {"to_rollout": [], "to_train": []}
    for _ in range(SWITCHES):
        r = h.call(1, "to_rollout", version=3, weights=str(run / "weights" / "v3"))
        switches["to_rollout"].append(reply_dict(r))
        r = h.call(1, "to_train", version=3, checkpoint=str(run / "checkpoints" / "v3"))
        switches["to_train"].append(reply_dict(r))
    out["switches"] = switches


def head_main(comm, run: Path, model: Path, key_file: Path, out_path: Path) -> int:
    out: dict = {"checks": {}}
    h = Head(comm, key_file.read_text().strip(), out)
    try:
        scenario(h, run, model, out)
    except Exception:
        out["error"] = traceback.format_exc()
    finally:
        try:
            out["stop"] = [reply_dict(x) for x in h.call_all(range(h.cells), "stop")]
        except Exception:
            out["stop_error"] = traceback.format_exc()
        out["events"] = [[e.cell, e.kind, e.info] for e in h.events if e.kind != "heartbeat"]
        out["heartbeats"] = sum(e.kind == "heartbeat" for e in h.events)
        h.link.stop()
        out_path.write_text(json.dumps(out, indent=1, default=str))
    return 0 if "error" not in out else 1


def main() -> int:
    run, model, key_file, out_path = map(Path, sys.argv[1:5])
    from gyre.cell.mpi_link import init_mpi

    MPI = init_mpi()

    comm = MPI.COMM_WORLD
    if comm.Get_rank() != 0:
        from gyre.cell.main import main as agent_main
        from gyre.cluster.placement import cell_placement

        on_slurm = ["engine.host=0.0.0.0"] if os.environ.get("SLURM_JOB_ID") else []  # the head is on another node
        return agent_main(["--run-dir", str(run), "--model", str(model), "--engine-key-file", str(key_file),
                           *TRAIN_OVERRIDES, *on_slurm], place=cell_placement)
    return head_main(comm, run, model, key_file, out_path)


if __name__ == "__main__":
    sys.exit(main())

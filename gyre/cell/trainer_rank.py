"""One trainer rank of a cell: ``python -m gyre.cell.trainer_rank`` (started by gyre.cell.trainer_process).

A cell's trainer is ``size`` of these processes, one per GPU slot (one per node on CPU), spread
over the cell's nodes (an ``srun`` step under Slurm, local processes under ``gyre run``). They form
the cell's torch.distributed world (gloo on CPU, NCCL on GPU) with Megatron-Core's parallel state
inside it. Rank 0 connects back to the cell agent and receives its requests (typed messages,
gyre.cell.trainer_messages, dispatched by type: ``Rank.HANDLERS``); every request is
broadcast to all ranks, which all carry it out (forward/backward on their rows of the micro-batch,
offload, restore, reduce, optimizer step, export and checkpoint), and rank 0 answers for the cell.

Gradients never leave the trainer ranks: ``stash`` sums this step's gradients over the cell into a
held vector (so the trainer is between steps and can offload), ``reduce`` sums the held vectors of
the member cells over a cross-cell process group (gyre.cell.groups), ``apply`` takes the step.
A reduce that has to be retried for the same step (a member died) contributes the same held vector
again; a rank that already applied that step only contributes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any, Callable

from gyre import faults
from gyre.config import TrainBackend, TrainConfig, env
from gyre.messages import dispatch_table, handler_for
from gyre.train.pace import TrainPacer
from gyre.position import Position
from gyre.cell.trainer_messages import (Applied, Apply, Close, ExportWeights, ForwardBackward, Hostnames, LoadCheckpoint,
                                 Logprobs, Offload, ReduceGrads, GradsReduced, Reply, Request, Restore, SaveCheckpoint, Start, Started,
                                 Stash, Stashed)

CTRL_TIMEOUT = datetime.timedelta(days=30)   # ranks wait for the agent's next request this long


def _env_int(*names: str) -> int | None:
    for n in names:
        v = env(n)
        if v not in (None, ""):
            return int(v)
    return None


def merge_stats(parts: list[dict | None]) -> dict:
    """One micro-batch's stats from its row slices on the ranks (the rule of gyre.train.step_stats)."""
    from gyre.train.step_stats import merge  # the head imports merge_stats: no trainer code at its import

    return merge(parts, parallel=True)


def rows_of(mb, rank: int, size: int):
    """The rows ``rank::size`` of a micro-batch (every field, `gyre.batch.select_rows`); None if
    it has none."""
    from gyre.batch import select_rows  # torch: loaded in the trainer process only

    if size == 1:
        return mb
    return select_rows(mb, list(range(rank, mb.input_ids.shape[0], size)))


def targets_of(mb, rank: int, size: int):
    """Indices (numpy) in the whole micro-batch of the targets `rows_of(mb, rank, size)` keeps, in
    its order."""
    return ((mb.pred_pos // mb.input_ids.shape[1]) % size == rank).nonzero().view(-1).numpy()


class Rank:
    """What every rank does for each request (all ranks call the same handler in the same order;
    ``HANDLERS`` maps each request type to its handler)."""

    def __init__(self, init: Start, *, cell: int, rank: int, size: int, store, incarnation: str) -> None:
        import torch
        import torch.distributed as dist

        from gyre.cell.groups import CrossCellReducer  # torch: trainer process only
        from gyre.train.backends import make_trainer  # as above

        self.cell, self.rank, self.size, self.store = cell, rank, size, store
        cfg = TrainConfig(**init.cfg)
        if cfg.backend == TrainBackend.MEGATRON:
            from gyre.train.dist import init_megatron  # as above

            init_megatron(tensor_parallel=cfg.tensor_parallel, pipeline_parallel=cfg.pipeline_parallel,
                          expert_parallel=cfg.expert_parallel, context_parallel=cfg.context_parallel,
                          seed=init.seed)
        elif cfg.tensor_parallel * cfg.pipeline_parallel * cfg.expert_parallel != 1:
            raise ValueError("train.tensor_parallel / pipeline_parallel / expert_parallel > 1 need "
                             "train.backend = \"megatron\"")
        self.trainer = make_trainer(cfg, init.model_dir, seed=init.seed)
        if init.checkpoint:
            self.trainer.load_checkpoint(init.checkpoint)
        elif init.init_state:
            self.trainer.load_checkpoint(init.init_state, as_start=True)
        self.trainer.own_storage()  # so that offload can release what was loaded
        if init.offloaded:
            self.trainer.offload()
        self.dp_group, self.dp_rank, self.dp_size = self._data_parallel()
        self.pacer = TrainPacer(cfg.pace_tokens_per_s, self.dp_size) if cfg.pace_tokens_per_s > 0 else None
        self.grad_group, self.grad_size = self._gradient_group()
        self.device = self.trainer.device
        self.reducer = CrossCellReducer(store, cell=cell, local_rank=rank, incarnation=incarnation,
                                        device=self.device if self.device.type == "cuda" else torch.device("cpu"))
        # gradients are keyed by (step, update): a step with minibatches has one reduce per update
        self.held: torch.Tensor | None = None   # this cell's summed gradients of update held_at
        self.held_at: Position | None = None
        self.total: torch.Tensor | None = None  # the cross-cell sum of the last reduce
        self.total_at: Position | None = None
        self._dist = dist

    def _data_parallel(self):
        """The cell's data-parallel group of this rank (Megatron's, or the whole cell)."""
        dist = __import__("torch.distributed", fromlist=["x"])
        if self.trainer.cfg.backend == TrainBackend.MEGATRON:
            from megatron.core import parallel_state as ps

            return ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        return dist.group.WORLD, self.rank, self.size

    def _gradient_group(self):
        """The ranks whose gradients add up to the cell's: data parallel, and under context
        parallelism (train.context_parallel) the CP ranks too, each of which holds the gradient
        of its own part of the same rows (Megatron's dp-cp group)."""
        if self.trainer.cfg.backend == TrainBackend.MEGATRON and self.trainer.cfg.context_parallel > 1:
            from megatron.core import parallel_state as ps

            return (ps.get_data_parallel_group(with_context_parallel=True),
                    ps.get_data_parallel_world_size(with_context_parallel=True))
        return self.dp_group, self.dp_size

    # --- requests -------------------------------------------------------------------------------
    def _new_step(self, step: int, update: int = 0) -> None:
        at = Position(step, update)
        if self.held_at is None or at > self.held_at:  # the held gradients of an older (committed) update are done with
            self.held, self.held_at = None, at

    def forward_backward(self, m: ForwardBackward) -> dict | None:
        from gyre.batch import from_wire  # as above

        faults.hit("trainer", "micro_batch")
        if m.update:
            faults.hit("trainer", "later_minibatch")
        self._new_step(m.step, m.update)
        t0 = self.pacer.start() if self.pacer is not None else 0.0
        mb = rows_of(from_wire(m.wire_mb), self.dp_rank, self.dp_size)
        out = self.trainer.forward_backward(mb) if mb is not None else None
        if self.pacer is not None and out is not None:  # train.pace_tokens_per_s (benchmarks only)
            self.pacer.hold(t0, out["tokens"])
        return out

    def logprobs(self, m: Logprobs):
        """(indices of this rank's targets in the whole micro-batch, their log-probs), or None."""
        from gyre.batch import from_wire  # as above

        full = from_wire(m.wire_mb)
        mb = rows_of(full, self.dp_rank, self.dp_size)
        if mb is None:
            return None
        return targets_of(full, self.dp_rank, self.dp_size), self.trainer.logprobs(mb).numpy()

    def _local_grads(self):
        from gyre.train.trainer import Trainer  # as above

        # the base implementation: this rank's own accumulated gradients, no reduction
        return Trainer.flat_grads(self.trainer)

    def stash(self, m: Stash) -> Stashed:
        """Sum this step's gradients over the cell into ``held``; the trainer is then between steps."""
        faults.hit("trainer", "prepare_reduce")
        return self._stash(m.step, m.update)

    def _stash(self, step: int, update: int = 0) -> Stashed:
        self._new_step(step, update)
        if self._any_work() == 0:  # collective: every rank takes the same branch
            return Stashed(held=self.held is not None)
        g = self._local_grads().to(self.device)
        if self.grad_size > 1:
            self._dist.all_reduce(g, group=self.grad_group)
        g = g.cpu()
        self.held = g if self.held is None else self.held + g
        self.trainer.clear_gradients()
        return Stashed(held=True)

    def _any_work(self) -> int:
        """Micro-batch slices done since the last stash on any rank of the cell (collective)."""
        import torch

        n = torch.tensor([float(self.trainer.pending_micro_batches)])
        if self.size > 1:
            self._dist.all_reduce(n, group=self.ctrl)
        return int(n.item())

    def reduce(self, m: ReduceGrads) -> GradsReduced:
        """Sum the held gradients over the member cells: shard ``dp_rank`` of the vector crosses
        cells among the ranks of the same coordinate, then the cell gathers the shards."""
        import torch

        from gyre.cell.groups import shard_bounds  # as above

        step, members, attempt = m.step, list(m.members), m.attempt
        faults.hit("trainer", "reduce")
        self._stash(step, m.update)  # a no-op after prepare_reduce
        n = self.trainer.num_grad_elements()
        local = self.held if self.held is not None else torch.zeros(n)
        lo, hi = shard_bounds(n, self.dp_size, self.dp_rank)
        res, error = None, None
        try:
            res = self.reducer.allreduce(local[lo:hi], Position(step, m.update), members, attempt)
        except Exception as e:  # noqa: BLE001 - the cell's other ranks must hear it before gathering
            error = e
        failed = torch.tensor([0.0 if error is None else 1.0])
        if self.size > 1:
            self._dist.all_reduce(failed, group=self.ctrl)
        if failed.item():
            self.reducer.forget(members)
            raise error if error is not None else RuntimeError("another rank of the cell failed the reduce")
        total = res.total
        if self.dp_size > 1:
            pieces = [torch.empty(b - a, dtype=torch.float32, device=total.device)
                      for a, b in (shard_bounds(n, self.dp_size, i) for i in range(self.dp_size))]
            self._dist.all_gather(pieces, total, group=self.dp_group)
            total = torch.cat(pieces)
        self.total, self.total_at = total.cpu(), Position(step, m.update)
        return GradsReduced(form_ms=res.form_ms, cached=res.cached, wait_ms=res.wait_ms,
                       grad_norm_total=float(total.double().norm()))

    def apply(self, m: Apply) -> Applied:
        step, update = m.step, m.update
        faults.hit("trainer", "optimizer_step")
        if self.total is None or self.total_at != Position(step, update):
            raise RuntimeError(f"apply: no reduced gradients of step {step} update {update}")
        if Position(self.trainer.step, self.trainer.update) != Position(step, update):
            raise RuntimeError(f"apply: the trainer is at step {self.trainer.step} update {self.trainer.update}, "
                               f"not step {step} update {update}")
        self.trainer.set_flat_grads(self.total.to(self.device))
        out = self.trainer.apply_gradients(final=m.final)
        self.total = None
        return Applied(step=out["step"], grad_norm=out["grad_norm"], stats=out)

    def export_weights(self, m: ExportWeights) -> str:
        from gyre.train.export import export_pieces  # as above

        faults.hit("trainer", "export")
        return str(export_pieces(self.trainer.hf_state_dict(), self.trainer.hf_config, m.out_dir, m.version,
                                 rank=self.rank, size=self.size, barrier=self.barrier, broadcast=self.bcast))

    def save_checkpoint(self, m: SaveCheckpoint) -> str:
        faults.hit("trainer", "checkpoint")
        return str(self.trainer.save_checkpoint(m.path))

    def load_checkpoint(self, m: LoadCheckpoint) -> None:
        self.trainer.load_checkpoint(m.path)
        self.trainer.own_storage()
        self.held, self.held_at, self.total = None, None, None

    def offload(self, m: Offload) -> dict:
        return self.trainer.offload()

    def restore(self, m: Restore) -> dict:
        return self.trainer.restore()

    def hostname(self, m: Hostnames) -> str:
        return socket.gethostname()

    # --- collectives of the control path --------------------------------------------------------
    ctrl = None

    def barrier(self) -> None:
        if self.size > 1:
            self._dist.barrier(group=self.ctrl)

    def bcast(self, obj):
        if self.size == 1:
            return obj
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    # request type -> handler (gyre.messages: the agent's table of the head's commands is built alike)
    HANDLERS: dict[type[Request], Callable[[Rank, Any], Any]] = dispatch_table({
        ForwardBackward: forward_backward, Logprobs: logprobs, Stash: stash, ReduceGrads: reduce, Apply: apply,
        ExportWeights: export_weights, SaveCheckpoint: save_checkpoint, LoadCheckpoint: load_checkpoint,
        Offload: offload, Restore: restore, Hostnames: hostname})

    def handle(self, req: Any) -> Reply:
        """This rank's answer to one request: the handler's value, or the error's text."""
        return dispatch(self.HANDLERS, self, req)


def dispatch(handlers: dict, target: Any, req: Any) -> Reply:
    """Run the handler of ``req``'s type on ``target``; an unknown type is an error reply
    (gyre.messages.handler_for's, as the agent's for an unknown command)."""
    try:
        return Reply(value=handler_for(handlers, req, "trainer request")(target, req))
    except Exception as e:  # noqa: BLE001 - the agent hears why
        return Reply(error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")


def merge_logprobs(values: list) -> "np.ndarray":
    """One micro-batch's target log-probs, in target order, from the ranks' (indices, values)."""
    import numpy as np

    parts = [v for v in values if v is not None]  # every target is on some rank's rows
    out = np.zeros(max((int(i.max()) + 1 for i, _ in parts if len(i)), default=0), dtype=np.float32)
    for idx, lp in parts:  # ranks of one data-parallel coordinate write the same values
        out[idx] = lp
    return out


def _merge_reduced(values: list[GradsReduced]) -> GradsReduced:
    return dataclasses.replace(values[0], form_ms=max(v.form_ms for v in values), cached=all(v.cached for v in values))


# how rank 0 makes the cell's answer from every rank's value; other requests: rank 0's own
MERGE: dict[type, Callable[[list], Any]] = {ForwardBackward: merge_stats, Hostnames: list, ReduceGrads: _merge_reduced,
                                            Logprobs: merge_logprobs}


def combine(req: Request | None, results: list[Reply]) -> Reply:
    """Rank 0's answer for the cell from every rank's reply (``req`` None: the start)."""
    errors = [f"rank {i}: {r.error}" for i, r in enumerate(results) if not r.ok]
    if errors:
        return Reply(error="; ".join(errors))
    values = [r.value for r in results]
    merge = MERGE.get(type(req))
    return Reply(value=merge(values) if merge is not None else values[0])


def serve(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from gyre.cell.groups import connect_store  # torch.distributed: trainer process only

    rank = args.rank if args.rank is not None else _env_int("SLURM_PROCID")
    size = args.size if args.size is not None else _env_int("SLURM_NTASKS")
    if rank is None or size is None:
        print("gyre.cell.trainer_rank: give --rank/--size or run under srun", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # cells share cores with their engine and with each other
    host, port = args.store.rsplit(":", 1)
    store = connect_store(host, int(port))
    cuda = torch.cuda.is_available()
    if cuda:  # one rank per GPU slot: Slurm's local id (or the rank) picks the device
        local = _env_int("SLURM_LOCALID", "LOCAL_RANK") or 0
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore(f"cell/{args.cell}/{args.gen}/", store),
                            rank=rank, world_size=size, timeout=datetime.timedelta(seconds=args.timeout_s))
    ctrl = dist.new_group(backend="gloo", timeout=CTRL_TIMEOUT) if size > 1 else None
    conn = None
    if rank == 0:
        ahost, aport = args.agent.rsplit(":", 1)
        conn = Client((ahost, int(aport)), authkey=bytes.fromhex(os.environ["GYRE_TRAINER_AUTHKEY"]))
        init = conn.recv()
    else:
        init = None
    if size > 1:
        box = [init]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        init = box[0]
    try:
        r = Rank(init, cell=args.cell, rank=rank, size=size, store=store, incarnation=f"{args.cell}.{args.gen}")
        r.ctrl = ctrl
        reply = Reply(value=Started(num_grad_elements=r.trainer.num_grad_elements(), ranks=size))
    except Exception as e:  # noqa: BLE001 - the agent hears why
        r, reply = None, Reply(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    if size > 1:
        gathered = [None] * size if rank == 0 else None
        dist.gather_object(reply, gathered, dst=0, group=ctrl)
        reply = combine(None, gathered) if rank == 0 else reply
    if rank == 0:
        conn.send(dataclasses.replace(reply, step=r.trainer.step if r else None,
                                      update=r.trainer.update if r else None))
    if r is None:
        return 1
    while True:
        if rank == 0:
            try:
                req = conn.recv()
            except (EOFError, OSError):
                req = Close()
        else:
            req = None
        req = r.bcast(req)
        if isinstance(req, Close):
            return 0
        reply = r.handle(req)
        if size > 1:
            gathered = [None] * size if rank == 0 else None
            dist.gather_object(reply, gathered, dst=0, group=ctrl)
            if rank == 0:
                reply = combine(req, gathered)
        elif type(req) in MERGE:
            reply = combine(req, [reply])
        if rank == 0:
            conn.send(dataclasses.replace(reply, step=r.trainer.step, update=r.trainer.update))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyre.cell.trainer_rank", description="one trainer rank of a cell (internal)")
    p.add_argument("--cell", type=int, required=True)
    p.add_argument("--gen", type=int, required=True, help="trainer incarnation of the cell (restarts count up)")
    p.add_argument("--rank", type=int, default=None, help="default $SLURM_PROCID")
    p.add_argument("--size", type=int, default=None, help="default $SLURM_NTASKS")
    p.add_argument("--store", required=True, help="HOST:PORT of the job's TCPStore")
    p.add_argument("--agent", required=True, help="HOST:PORT where the cell agent waits for rank 0")
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on one collective inside the cell")
    args = p.parse_args(argv)
    faults.hit("trainer", "start")
    return serve(args)


if __name__ == "__main__":
    from gyre.fast_exit import exit_now

    exit_now(main())  # without the interpreter's ~1-2 s teardown (torch): see gyre/fast_exit.py

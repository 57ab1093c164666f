"""Cross-cell gradient reduction over torch.distributed process groups, one per membership.

Every trainer rank of every cell reaches one job-wide key-value store (a `TCPStore` served by cell 0's
agent). A reduce over the cells ``members`` runs, on local rank ``r`` of each member cell, an
all-reduce among the ranks ``r`` of the member cells: a process group made for exactly that
membership the first time it is needed and cached, so a cell that joins mid-step simply makes the
next reduce use (and, once, form) a group with it.

Why groups from a store and not ``new_group`` on one global world: a torch.distributed world
cannot take back a process that died, and a cell's trainer is restarted after a crash. A group
keyed by the membership *and* each member's trainer incarnation is made again, from the same
store, when a member restarts; nothing else changes. (`new_group` would also need every rank of
the world to call it, including cells busy serving rollouts.)

Each reduce attempt has a rendezvous in the store: every member writes its incarnation, so all
members pick the same cached group or all form the same new one; an agent whose trainer died
writes ``abort`` so that the others stop waiting instead of timing out. Data never goes through
the store: it carries a few short keys per attempt.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gyre.position import Position

FORM_TIMEOUT_S = 120.0     # bound on waiting for the other members of a reduce
POLL_S = 0.002


class ReduceAborted(RuntimeError):
    """A member of the reduce died (its agent said so) or did not come in time."""


def connect_store(host: str, port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def serve_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """The job's store (cell 0's agent): any free port, every interface."""
    return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def attempt_key(at: Position, members: list[int], attempt: int) -> str:
    """The store prefix of one reduce attempt of the update starting at ``at`` (a step that makes
    several optimizer updates, train.minibatches_per_step, has one reduce per update)."""
    return f"reduce/{at.key}/{'-'.join(map(str, members))}/{attempt}"


def abort_attempt(store, at: Position, members: list[int], attempt: int, why: str) -> None:
    store.set(attempt_key(at, members, attempt) + "/abort", why)


def new_group(store, rank: int, size: int, prefix: str, device: torch.device, timeout_s: float):
    """A process group of ``size`` ranks on its own store prefix (gloo on CPU, NCCL on GPU)."""
    pstore = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":  # unchecked here (no GPU): the documented c10d constructor
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(pstore, rank, size, opts)
    return dist.ProcessGroupGloo(pstore, rank, size, timeout)


@dataclass
class ReduceResult:
    total: torch.Tensor     # the sum over every member cell (float32, on the trainer's device)
    form_ms: float          # time to form the group (0 when it came from the cache)
    cached: bool
    wait_ms: float          # time spent waiting for the other members to arrive


class CrossCellReducer:
    """One per trainer rank: sums a cell's gradient vector with the other member cells'."""

    def __init__(self, store, *, cell: int, local_rank: int, incarnation: str, device: torch.device,
                 timeout_s: float = FORM_TIMEOUT_S) -> None:
        self.store, self.cell, self.local_rank = store, cell, local_rank
        self.incarnation, self.device, self.timeout_s = incarnation, device, timeout_s
        self._groups: dict[tuple, object] = {}

    def _wait(self, keys: list[str], abort: str, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            if self.store.check([abort]):
                raise ReduceAborted(f"{what}: aborted ({self.store.get(abort).decode(errors='replace')})")
            if time.monotonic() > deadline:
                raise ReduceAborted(f"{what}: the other members did not arrive within {self.timeout_s:.0f} s")
            time.sleep(POLL_S)

    def group(self, at: Position, members: list[int], attempt: int):
        """The cached (or a new) group of local rank ``local_rank`` of every member cell, agreed
        through this attempt's rendezvous; returns (group, form_ms, cached, wait_ms)."""
        base = attempt_key(at, members, attempt)
        abort = base + "/abort"
        self.store.set(f"{base}/inc/{self.cell}.{self.local_rank}", self.incarnation)
        t0 = time.perf_counter()
        keys = [f"{base}/inc/{c}.{self.local_rank}" for c in members]
        self._wait(keys, abort, f"reduce of step {at.step} over cells {members}")
        incs = tuple(self.store.get(k).decode() for k in keys)
        wait_ms = 1000 * (time.perf_counter() - t0)
        key = (tuple(members), incs)
        if key in self._groups:
            return self._groups[key], 0.0, True, wait_ms
        for old in [k for k in self._groups if k[0] == key[0]]:
            del self._groups[old]  # a member restarted: that group can never complete again
        t0 = time.perf_counter()
        prefix = f"pg/{'-'.join(map(str, members))}/{'-'.join(incs)}/r{self.local_rank}/"
        pg = new_group(self.store, members.index(self.cell), len(members), prefix, self.device, self.timeout_s)
        form_ms = 1000 * (time.perf_counter() - t0)
        self._groups[key] = pg
        return pg, form_ms, False, wait_ms

    def forget(self, members: list[int]) -> None:
        """Drop the cached groups of this membership (after a failed collective)."""
        for k in [k for k in self._groups if k[0] == tuple(sorted(members))]:
            del self._groups[k]

    def allreduce(self, vec: torch.Tensor, at: Position, members: list[int], attempt: int) -> ReduceResult:
        """Sum ``vec`` over the member cells (same local rank); ``vec`` itself is left intact,
        so a failed attempt can be retried with the same contribution."""
        members = sorted(members)
        if self.cell not in members:
            raise ValueError(f"cell {self.cell} is not among the members {members}")
        pg, form_ms, cached, wait_ms = self.group(at, members, attempt)
        out = vec.detach().to(self.device, torch.float32).clone()
        if len(members) > 1:
            abort = attempt_key(at, members, attempt) + "/abort"
            work = pg.allreduce([out])
            deadline = time.monotonic() + self.timeout_s
            while not work.is_completed():  # a peer that died fails the work; an abort ends the wait
                if self.store.check([abort]) or time.monotonic() > deadline:
                    self.forget(members)
                    raise ReduceAborted(f"reduce of step {at.step} over cells {members}: aborted during the all-reduce")
                time.sleep(POLL_S)
            try:
                work.wait()
            except Exception as e:  # noqa: BLE001 - a member died inside the collective
                self.forget(members)
                raise ReduceAborted(f"reduce of step {at.step} over cells {members}: {e}") from e
        return ReduceResult(out, form_ms, cached, wait_ms)


def shard_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of the ``index``-th of ``parts`` near-equal slices of ``n`` elements."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)

"""MPI transport of the control protocol (gyre.sched.protocol): helpers for both sides.

Cells are numbered ``cell = rank - 1`` (rank 0 is the head). Nothing here blocks without a
bound: receives poll with ``Iprobe`` and short sleeps, so a loop can also watch its children,
send heartbeats or notice a stop flag. Importing this module never initialises MPI: the entry
points call `init_mpi()` when they start.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable

from gyre.sched.protocol import TAG_COMMAND, TAG_EVENT, TAG_REPLY, Command, Event, Reply

log = logging.getLogger(__name__)

HEAD = 0


def init_mpi():
    """Import mpi4py (which initialises MPI) and return its ``MPI`` module.

    The PyPI ``mpich`` wheel defaults to its UCX netmod, which publishes every rank's whole UCX
    address through PMI in run-length-coded segments; on a machine with more transports a segment's
    request line passes the 1,024 bytes Slurm's pmi2 plugin reads ("value not properly terminated",
    then UCX aborts on the torn address; seen in CI). Gyre's MPI carries control messages only, so
    the OFI netmod (addresses of tens of bytes) is the default here; a site's own choice wins.
    Other MPIs ignore the variable."""
    os.environ.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
    from mpi4py import MPI

    return MPI


def one_machine_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for an MPI job whose ranks all run on this machine (`gyre run`): the OFI
    netmod on loopback. Left to itself the provider binds the first interface it lists, which
    may be a bridge or a VPN that goes away mid-run (seen: a Slurm dev cluster's bridge torn down
    while a `gyre run` ran beside it failed its MPI_Finalize, "default nic=gyrebr0"); loopback is
    always there. MPICH's libfabric picks the `sockets` provider over `tcp` here (it scores
    higher), and each provider reads its own interface variable, so both are set. A site's own
    choice wins."""
    out = dict(os.environ if env is None else env)
    for var in ("FI_SOCKETS_IFACE", "FI_TCP_IFACE"):
        out.setdefault(var, "lo")
    return out


def cell_rank(cell: int) -> int:
    return cell + 1


def rank_cell(rank: int) -> int:
    return rank - 1


def send(comm, obj: Any, dest: int, tag: int) -> None:
    """Blocking pickled send. Use it for small messages (replies, events): MPI sends those
    eagerly, so it returns without waiting for the receiver. Bulk goes through `isend`."""
    comm.send(obj, dest=dest, tag=tag)


def poll(comm, source: int, tag: int, timeout_s: float, sleep_s: float = 0.002) -> Any | None:
    """The next message from ``source`` with ``tag`` (ANY_SOURCE/ANY_TAG allowed), or None after
    ``timeout_s`` (0 = just look once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if comm.iprobe(source=source, tag=tag):
            return comm.recv(source=source, tag=tag)
        if time.monotonic() >= deadline:
            return None
        time.sleep(sleep_s)


def recv_command(comm, timeout_s: float) -> Command | None:
    """Cell side: the head's next command, or None after ``timeout_s``."""
    msg = poll(comm, HEAD, TAG_COMMAND, timeout_s)
    if msg is not None and not isinstance(msg, Command):
        # nothing to answer (no seq): drop it rather than let it end the agent
        log.error("cell: dropped a %s sent with the command tag", type(msg).__name__)
        return None
    return msg


def send_reply(comm, reply: Reply) -> None:
    send(comm, reply, HEAD, TAG_REPLY)


def _stamped(event: Event) -> Event:
    if not event.t:
        event.t = time.time()
    return event


def send_event(comm, event: Event) -> None:
    send(comm, _stamped(event), HEAD, TAG_EVENT)


def isend_event(comm, event: Event):
    """Non-blocking `send_event` (for heartbeats: a head that stopped reading must not hold a
    cell in a send); returns the request, which keeps the pickled buffer alive until it completes."""
    return comm.isend(_stamped(event), dest=HEAD, tag=TAG_EVENT)


class HeadLink:
    """Rank 0's side: one thread owns every MPI call of the head (so MPI needs no thread
    support beyond the default), others talk to it through a queue and a callback.

    ``send_command(cell, cmd)`` is thread-safe and never blocks: commands go out with ``isend``,
    so a cell that is busy (e.g. in a forward pass) while a large micro-batch waits for it does
    not stall the messages of the other cells. ``on_message(msg)`` is called on the link thread
    for every Reply and Event; bridge it into asyncio with ``loop.call_soon_threadsafe``.
    """

    def __init__(self, comm, on_message: Callable[[Reply | Event], Any], *, idle_sleep_s: float = 0.001,
                 max_idle_sleep_s: float = 0.008):
        if comm.Get_rank() != HEAD:
            raise RuntimeError(f"HeadLink runs on rank {HEAD}, not on rank {comm.Get_rank()}")
        self.comm = comm
        self.cells = comm.Get_size() - 1
        self._on_message = on_message
        # idle: look again after idle_sleep_s, doubling up to max_idle_sleep_s while nothing moves
        # (a fixed 1 ms look cost the idle head ~2 % of a core, 1 % with the back-off); a command to send
        # wakes the thread at once (`_wake`), so only replies wait, at most max_idle_sleep_s
        self._idle_sleep_s, self._max_idle_sleep_s = idle_sleep_s, max_idle_sleep_s
        self._wake = threading.Event()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._stop_by = 0.0
        self._thread = threading.Thread(target=self._run, name="gyre-head-mpi", daemon=True)
        self.error: BaseException | None = None  # what ended the thread, if not stop()

    def start(self) -> "HeadLink":
        self._thread.start()
        return self

    def send_command(self, cell: int, cmd: Command) -> None:
        if not 0 <= cell < self.cells:
            raise ValueError(f"no cell {cell}: this job has cells 0..{self.cells - 1}")
        if not self._thread.is_alive():
            raise RuntimeError(f"the MPI link thread is not running ({self.error or 'stopped'})")
        self._out.put((cell_rank(cell), cmd))
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after sending what is queued (bounded by ``timeout_s``)."""
        self._stop_by = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s + 1.0)

    def __enter__(self) -> "HeadLink":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        sending: list = []  # isend requests in flight (each holds its pickled buffer)
        idle_s = self._idle_sleep_s
        try:
            while True:
                busy = False
                while True:
                    try:
                        dest, cmd = self._out.get_nowait()
                    except queue.Empty:
                        break
                    sending.append(self.comm.isend(cmd, dest=dest, tag=TAG_COMMAND))
                    busy = True
                sending = [r for r in sending if not r.Test()]
                while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                    msg = self.comm.recv(source=status.Get_source(), tag=status.Get_tag())
                    busy = True
                    if status.Get_tag() not in (TAG_REPLY, TAG_EVENT):
                        log.warning("head: ignoring a message with tag %s from rank %s",
                                    status.Get_tag(), status.Get_source())
                        continue
                    try:
                        self._on_message(msg)
                    except Exception:  # a bad callback must not cut the head off its cells
                        log.exception("head: on_message failed for %r", msg)
                if self._stop.is_set() and ((not sending and self._out.empty())
                                            or time.monotonic() > self._stop_by):
                    if sending:
                        log.warning("head: %d command(s) still unsent at stop", len(sending))
                    return
                if busy:
                    idle_s = self._idle_sleep_s
                else:
                    self._wake.wait(idle_s)  # set by send_command/stop: the queue is drained next
                    self._wake.clear()
                    idle_s = min(2 * idle_s, self._max_idle_sleep_s)
        except BaseException as e:  # noqa: BLE001 - recorded for send_command's error message
            self.error = e
            log.exception("head: MPI link thread failed")

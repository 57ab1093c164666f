"""A cell that cannot start (its engine key file is readable by others) reports Event fatal and
keeps answering, ok=False, until stop; every rank then exits 0.

    mpiexec -n 2 python tests/mpi_scripts/cell_start_fail.py RUN_DIR MODEL_DIR KEY_FILE OUT_JSON
"""

from __future__ import annotations

import json
import queue
import sys
from pathlib import Path


def head(comm, out_path: Path) -> int:
    from gyre.cell.mpi_link import HeadLink
    from gyre.sched.protocol import COMMANDS, Reply

    inbox: queue.Queue = queue.Queue()
    out: dict = {}
    with HeadLink(comm, inbox.put) as link:
        def next_msg():
            return inbox.get(timeout=60)

        fatal = next_msg()
        out["first_event"] = [fatal.kind, fatal.info]
        for kind in ("to_train", "stop"):
            cmd = COMMANDS[kind](**({"version": 0} if kind == "to_train" else {}))
            link.send_command(0, cmd)
            msg = next_msg()
            while not isinstance(msg, Reply):
                msg = next_msg()
            out[kind] = {"ok": msg.ok, "error": msg.error, "seq_matches": msg.seq == cmd.seq}
    out_path.write_text(json.dumps(out))
    return 0


def main() -> int:
    run, model, key_file, out_path = map(Path, sys.argv[1:5])
    from gyre.cell.mpi_link import init_mpi

    MPI = init_mpi()

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        return head(comm, out_path)
    from gyre.cell.main import main as agent_main
    from gyre.cluster.placement import cell_placement

    return agent_main(["--run-dir", str(run), "--model", str(model), "--engine-key-file", str(key_file)],
                      place=cell_placement)


if __name__ == "__main__":
    sys.exit(main())

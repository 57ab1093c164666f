"""gyre.cell: one cell's whole process tree: its supervisor (MPI rank r >= 1 of a job, cell r - 1).

* ``agent``: :class:`CellAgent`, which obeys the head's typed commands (gyre.sched.protocol).
* ``engine``: :class:`CellEngine`, the cell's engine behind the one engine seam and its typed
  admin calls (release, resume, abort, weights).
* ``placement``: :class:`Placement`, where the cell's processes run; built by ``gyre.cluster``
  (local processes or a Slurm step) and handed in, so this package knows nothing of Slurm.
* ``main``: the agent's process entry (start-up failures still answer the head).
* ``mpi_link``: MPI transport of the control protocol, for both sides (the head's ``HeadLink``).
* ``command``: what every command handler shares (its error, its phase timer).
* ``trainer_process``: :class:`TrainerProcess`, the agent's handle on the cell's trainer ranks.
* ``trainer_rank``: one trainer rank (``python -m gyre.cell.trainer_rank``), which calls gyre.train.
* ``trainer_messages``: the typed requests and replies between the agent and its ranks.
* ``groups``: the cross-cell gradient reduce groups the ranks form from the job's store.

Drivers (``gyre.cluster.main``) start it; nothing below imports it.
"""

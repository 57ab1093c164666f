"""When the head runs a validation round (gyre/services/validation.py runs the round itself).

A round runs at the committed version once the rollout cells serve it, one at a time, and once
more after the last step on its weights. These are the head's decisions (they use its task set,
its fleet and its notices), kept out of Head so that its loop reads top to bottom.
"""

from __future__ import annotations

import asyncio

from gyre.sched.state import Role
from gyre.services.validation import scalars


def if_due(head) -> None:
    """A round at the committed version once the rollout cells serve it, one at a time."""
    v, version = head.validation, head._committed
    if v is None or head.core.rollout_version != version or not v.due(version, head._start_version):
        if v is not None and v.busy_at(version, head._start_version):  # said, never silent
            head._notice("validation_waiting", {"version": version, "why": "the previous round still runs; "
                                                "this one starts when it ends unless a step ends first"})
        return
    v.task = head._spawn(_round(head, version), name=f"validation v{version}")


async def _round(head, version: int) -> None:
    line = await head.validation.round(version)
    if line is not None and head.outputs.metrics is not None:
        head.outputs.metrics.log(version, scalars(line), t=head.clock() - head.t0)


async def final(head) -> None:
    """After the last step: its weights on a rollout cell, then the last round."""
    v = head.validation
    others = [t for t in head._tasks if t is not v.task and not t.get_name().startswith("execution ")]
    await asyncio.gather(*others, return_exceptions=True)  # the last step is written down, its weights pushed
    if v.task is not None:
        await asyncio.gather(v.task, return_exceptions=True)
    version = head.core.rollout_version
    if not v.spec.at_end or v.finished(version) or head.failed:
        return
    if not head.fleet.in_role(Role.ROLLOUT):
        cell = next((c for c in head.cells if c.role is Role.TRAIN), None)
        if cell is None:
            head.fail("validation after the last step: no cell can serve it")
            return
        await head._to_rollout(cell)
    v.task = head._spawn(_round(head, version), name=f"validation v{version}")
    stop = asyncio.ensure_future(head._stop.wait())  # SIGTERM: its harnesses stop, a resume finishes it
    await asyncio.wait({v.task, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()

"""Test harness: the answer agent, with one group made slow deterministically (no timing luck).

    python hold_agent.py EXECUTION_ID   (env: GYRE_HOLD_DIR, GYRE_HOLD_PREFIX, GYRE_HOLD_MEMBERS,
                                              GYRE_HOLD_STEPS_FILE, GYRE_HOLD_UNTIL_STEPS)

Executions whose id starts with GYRE_HOLD_PREFIX (one group) run the answer agent, so their calls
are served by the weights of that moment, leave a marker in GYRE_HOLD_DIR, and then end only once
GYRE_HOLD_STEPS_FILE (the run's steps.jsonl) has GYRE_HOLD_UNTIL_STEPS rows: the group is scored
after the version has moved past its staleness bound. Every other execution waits until all
GYRE_HOLD_MEMBERS markers exist before it starts, so no step can close before the held group's calls
were served: its policy version is the first one, always. Waiting is on files (state), never on a
sleep landing at the right moment; the cap only keeps a broken run from hanging forever.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

CAP_S = 600.0


def wait_until(pred) -> None:
    deadline = time.monotonic() + CAP_S
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)


def rows(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def main() -> int:
    eid = sys.argv[1]
    marks = Path(os.environ["GYRE_HOLD_DIR"])
    prefix = os.environ["GYRE_HOLD_PREFIX"]
    agent = [sys.executable, "-m", "gyre.harness.answer_agent", *sys.argv[2:]]
    if eid.startswith(prefix):
        rc = subprocess.call(agent)
        marks.mkdir(parents=True, exist_ok=True)
        (marks / eid).write_text(str(rc))
        steps, until = Path(os.environ["GYRE_HOLD_STEPS_FILE"]), int(os.environ["GYRE_HOLD_UNTIL_STEPS"])
        wait_until(lambda: rows(steps) >= until)
        return rc
    members = int(os.environ["GYRE_HOLD_MEMBERS"])
    wait_until(lambda: marks.is_dir() and sum(1 for p in marks.iterdir() if p.name.startswith(prefix)) >= members)
    os.execv(sys.executable, agent)
    return 1


if __name__ == "__main__":
    sys.exit(main())

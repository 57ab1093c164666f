"""Test harness: the reference agent, with some executions stopped mid-run deterministically.

    python gate_agent.py EXECUTION_ID REFERENCE_AGENT_ARGS...   (env: GYRE_GATE_PREFIX, GYRE_GATE_DIR)

Executions whose id starts with GYRE_GATE_PREFIX run the reference agent (its calls recorded), leave
a marker in GYRE_GATE_DIR and then end only once GYRE_GATE_DIR/open exists: a test can stop the run
while they wait, each with its calls recorded, and open the gate before it resumes them. Every other
execution is the reference agent as is. Waiting is on files (state), never on a sleep landing at the
right moment; the cap only keeps a broken test from hanging forever.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

CAP_S = 600.0


def main() -> int:
    eid, args = sys.argv[1], sys.argv[2:]
    agent = [sys.executable, "-m", "gyre.harness.reference_agent", *args]
    if not eid.startswith(os.environ["GYRE_GATE_PREFIX"]):
        os.execv(sys.executable, agent)
    gate = Path(os.environ["GYRE_GATE_DIR"])
    rc = subprocess.call(agent)
    gate.mkdir(parents=True, exist_ok=True)
    (gate / eid).write_text(str(rc))
    deadline = time.monotonic() + CAP_S
    while not (gate / "open").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return rc


if __name__ == "__main__":
    sys.exit(main())

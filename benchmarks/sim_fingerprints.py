"""Fingerprints of simulated runs, to show a change to the simulator keeps every figure to the bit.

Runs 16 small scenarios (the 9 cases of tests/sim/test_simulator.py, router spreads, a 32-node
run, and KV pressure with hundreds of evictions) and prints, per run, the sha256 of every figure of
its SimResult (wall_s left out), its evictions, re-prefills and events. Run it before a change and
after, and compare (a refactor of the simulator must print the same lines):

    python benchmarks/sim_fingerprints.py > before.txt   # on the old code
    python benchmarks/sim_fingerprints.py > after.txt && diff before.txt after.txt

A tool, not a test: the hashes are whatever the model computes today, not a result to hold to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys

from gyre.sim.scenario import Scenario, nl2repo_cluster


def fingerprint(result) -> str:
    d = dataclasses.asdict(result)
    d.pop("wall_s", None)
    return hashlib.sha256(repr(sorted(d.items(), key=lambda kv: kv[0])).encode()).hexdigest()[:16]


def scenarios() -> list[tuple[str, Scenario]]:
    c16 = nl2repo_cluster(nodes=16, cell_nodes=4)
    out = [(f"{s}{k}", Scenario(s, k, c16, steps=6, groups_per_step=4, seed=0))
           for s, k in [("E", 0), ("E", 1), ("E", 2), ("E-paper", 0), ("E-paper", 2), ("A", 0), ("A", 2),
                        ("C", 0), ("C", 2)]]
    out += [("E1-spread", Scenario("E", 1, c16, steps=6, groups_per_step=4, seed=3, router_spread=(3, 1, 2))),
            ("A1-spread", Scenario("A", 1, c16, steps=4, groups_per_step=4, seed=1, router_spread=(1, 1))),
            ("E0-32n", Scenario("E", 0, nl2repo_cluster(nodes=32, cell_nodes=4), steps=8, groups_per_step=8,
                                seed=2))]
    for kv in (2e4, 6e4):  # KV tokens per replica: prefixes evicted, contexts re-prefilled
        small = nl2repo_cluster(nodes=16, cell_nodes=4, kv_tokens_per_replica=kv)
        out += [(f"E1-kv{kv:g}", Scenario("E", 1, small, steps=6, groups_per_step=4, seed=0)),
                (f"C1-kv{kv:g}", Scenario("C", 1, small, steps=6, groups_per_step=4, seed=5, router_spread=(2, 1)))]
    return out


def main(argv: list[str]) -> int:
    only = set(argv)
    for name, sc in scenarios():
        if only and name not in only:
            continue
        r = sc.run()
        print(name, fingerprint(r), r.evictions, r.reprefills, r.events, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

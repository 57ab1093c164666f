"""Tree saving on the paper's case-study-shaped execution: unique vs expanded nodes and tokens.

"Expanded" is what storing (or training) every candidate trajectory on its own would cost:
each leaf's root path counted in full. The paper reports 1,347 unique message nodes against
1,716 independent occurrences for its case study (636 calls, 10 candidate trajectories).
Writes benchmarks/results/tree.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.traj.synthetic import case_study  # noqa: E402

PAPER = {"paper_unique_nodes": 1347, "paper_expanded_nodes": 1716}
SEEDS = 8  # token counts vary with the seed (node counts do not): report their spread too


def main() -> dict:
    t0 = time.perf_counter()
    rec = case_study(seed=0)
    t_build = time.perf_counter() - t0
    s = rec.tree.stats()
    out = dict(s.as_dict())
    out.update(PAPER)
    out["node_ratio"] = s.expanded_nodes / s.unique_nodes
    out["token_ratio"] = s.expanded_tokens / s.unique_tokens
    out["paper_node_ratio"] = PAPER["paper_expanded_nodes"] / PAPER["paper_unique_nodes"]
    out["target_token_share"] = s.target_tokens / s.unique_tokens
    out["build_s"] = t_build
    out["build_calls_per_s"] = s.calls / t_build
    ratios = []
    for seed in range(1, SEEDS):
        x = case_study(seed=seed).tree.stats()
        ratios.append(x.expanded_tokens / x.unique_tokens)
    ratios.append(out["token_ratio"])
    out["token_ratio_min"], out["token_ratio_max"] = min(ratios), max(ratios)
    out["seeds"] = SEEDS
    out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}
    dest = ROOT / "benchmarks" / "results" / "tree.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))

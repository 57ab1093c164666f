"""Templates by token ids (issue 29 item 1): for each real chat template under tests/templates/
(sources in tests/templates/SOURCES), the fraction of a 5-call agent's calls (system message,
parallel tool calls, reasoning, a new user turn) whose prompt ids, as the proxy sends them to the
engine, equal transformers' ``apply_chat_template`` ids for the same messages.

``template_ids_equal_<name>``: under ``proxy.history = "template"`` (follow the template: the only
mode in which a template that rewrites history can equal transformers on every call). 0.0 when the
proxy refuses the model directory at start. The lead merges these keys into token_truth.json.

    PYTHONPATH=. .venv/bin/python benchmarks/token_truth_templates.py
writes benchmarks/results/token_truth_templates.json.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the fixture driver, the scripted engine, the loop thread

from support.template_fixtures import FIXTURES, drive, model_dir, script  # noqa: E402



def measure() -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in FIXTURES:
            directory = model_dir(name, Path(tmp) / name)
            try:
                calls = drive(directory, name, history="template")
            except Exception as e:  # refused at start: nothing served, nothing equal
                logging.warning("%s: the proxy refused the model directory: %s", name, e)
                out[f"template_ids_equal_{name}"] = 0.0
                continue
            for i, c in enumerate(calls):
                if not c.equal:
                    logging.warning("%s: call %d differs from transformers (%s)", name, i, c.error or "ids")
            # over the script's calls: a call after an error answer never happened (the agent stopped)
            out[f"template_ids_equal_{name}"] = sum(c.equal for c in calls) / len(script(FIXTURES[name]))
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    print(json.dumps(measure(), indent=2))  # bench_token_truth.py merges these keys into token_truth.json

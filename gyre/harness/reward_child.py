"""The reward subprocess (gyre.harness.reward): imports the user's ``module:function``, calls it
with the execution's payload, writes ``{"value": ...}``. Run by path and standard library only, so
it starts fast and the user's module is the only thing it imports."""

import importlib
import json
import sys
from pathlib import Path


def main(inp: str, out: str) -> int:
    spec = json.loads(Path(inp).read_text(encoding="utf-8"))
    module, _, name = spec["function"].partition(":")
    try:
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as e:
        print(f"cannot import reward.function {spec['function']!r}: {type(e).__name__}: {e} "
              "(reward.pythonpath names the folder holding the module)", file=sys.stderr)
        return 2
    p = spec["payload"]
    value = fn(workspace=p["workspace"], task=p["task"], tests=p["tests"], calls=p["calls"])
    try:
        text = json.dumps({"value": value})
    except (TypeError, ValueError) as e:
        print(f"the reward's value cannot be sent back: {e}", file=sys.stderr)
        return 3
    Path(out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

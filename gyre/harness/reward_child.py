"""The reward subprocess (gyre.harness.reward): imports the user's ``module:function``, calls it
with the execution's payload, answers ``{"value": ...}``. Run by path and standard library only, so
it starts fast, runs in a sandbox where the gyre package is hidden, and the user's module is the
only thing it imports.

    reward_child.py < {"function": "module:function", "payload": {...}}  > {"value": ...}

The request comes on stdin and the answer goes to stdout, so the sandbox needs no writable
mount of the host's: the function's own prints are sent to stderr (fd 1 is pointed at fd 2 before
its module is imported), and stdout carries the answer alone."""

import importlib
import json
import os
import sys


def main() -> int:
    answer = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # print() of the user's code lands in stderr, never in the answer
    spec = json.load(sys.stdin)
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
    answer.write(text)
    answer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

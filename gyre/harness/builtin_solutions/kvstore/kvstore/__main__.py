import argparse
import json
import sys

from .store import Store


def main(argv=None):
    p = argparse.ArgumentParser(prog="kvstore")
    p.add_argument("--file", required=True)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("set")
    s.add_argument("key")
    s.add_argument("value")
    sub.add_parser("get").add_argument("key")
    sub.add_parser("del").add_argument("key")
    sub.add_parser("keys")
    args = p.parse_args(argv)
    store = Store(args.file)
    if args.cmd == "set":
        try:
            value = json.loads(args.value)
        except json.JSONDecodeError:
            value = args.value
        store.set(args.key, value)
    elif args.cmd == "get":
        if args.key not in store:
            print(f"error: no such key: {args.key}", file=sys.stderr)
            return 1
        print(json.dumps(store.get(args.key)))
    elif args.cmd == "del":
        return 0 if store.delete(args.key) else 1
    else:
        for k in store.keys():
            print(k)
    return 0


sys.exit(main())

import json
import subprocess
import sys


def kv(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "kvstore", "--file", str(tmp_path / "db.json"), *args],
                          capture_output=True, text=True, timeout=60)


def test_set_and_get_json(tmp_path):
    assert kv(tmp_path, "set", "n", "[1, 2]").returncode == 0
    r = kv(tmp_path, "get", "n")
    assert r.returncode == 0 and json.loads(r.stdout) == [1, 2]


def test_set_plain_string(tmp_path):
    kv(tmp_path, "set", "s", "hello world")
    assert json.loads(kv(tmp_path, "get", "s").stdout) == "hello world"


def test_get_missing(tmp_path):
    r = kv(tmp_path, "get", "nope")
    assert r.returncode == 1 and "error: no such key: nope" in r.stderr


def test_del(tmp_path):
    kv(tmp_path, "set", "a", "1")
    assert kv(tmp_path, "del", "a").returncode == 0
    assert kv(tmp_path, "del", "a").returncode == 1


def test_keys_sorted(tmp_path):
    for k in ("b", "c", "a"):
        kv(tmp_path, "set", k, "0")
    assert kv(tmp_path, "keys").stdout.split() == ["a", "b", "c"]

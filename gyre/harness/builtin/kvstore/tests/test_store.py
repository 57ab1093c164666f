import json
import os

import pytest

from kvstore import Store


def test_empty_and_missing_file(tmp_path):
    s = Store(tmp_path / "db.json")
    assert len(s) == 0 and s.get("a") is None and s.get("a", 5) == 5 and s.keys() == []
    assert not (tmp_path / "db.json").exists()


def test_set_get_delete(tmp_path):
    s = Store(tmp_path / "db.json")
    s.set("b", [1, 2])
    s.set("a", {"x": None})
    assert s.keys() == ["a", "b"] and "a" in s and len(s) == 2
    assert s.delete("a") is True and s.delete("a") is False
    assert s.keys() == ["b"]


def test_persisted_immediately(tmp_path):
    path = tmp_path / "db.json"
    Store(path).set("k", 1.5)
    assert json.loads(path.read_text()) == {"k": 1.5}
    assert Store(path).get("k") == 1.5


def test_atomic_write_uses_replace(tmp_path, monkeypatch):
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((str(a), str(b))), real(a, b)))
    path = tmp_path / "db.json"
    Store(path).set("k", "v")
    assert replaced and replaced[-1][1] == str(path)
    assert os.path.dirname(replaced[-1][0]) == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["db.json"]


def test_bad_values_and_keys(tmp_path):
    s = Store(tmp_path / "db.json")
    with pytest.raises(TypeError):
        s.set("k", {1, 2})
    with pytest.raises(TypeError):
        s.set("k", [object()])
    with pytest.raises(ValueError):
        s.set("", 1)
    assert len(s) == 0


def test_get_returns_copy(tmp_path):
    s = Store(tmp_path / "db.json")
    s.set("k", [1])
    s.get("k").append(2)
    assert s.get("k") == [1]


def test_transaction_commit(tmp_path):
    path = tmp_path / "db.json"
    s = Store(path)
    with s.transaction():
        s.set("a", 1)
        s.set("b", 2)
        assert s.get("a") == 1
        assert not path.exists()
    assert Store(path).keys() == ["a", "b"]


def test_transaction_rollback(tmp_path):
    path = tmp_path / "db.json"
    s = Store(path)
    s.set("a", 1)
    with pytest.raises(KeyError):
        with s.transaction():
            s.set("a", 2)
            s.delete("a")
            s.set("c", 3)
            raise KeyError("boom")
    assert s.get("a") == 1 and "c" not in s
    assert Store(path).keys() == ["a"]


def test_nested_transaction(tmp_path):
    s = Store(tmp_path / "db.json")
    with s.transaction():
        with pytest.raises(RuntimeError):
            with s.transaction():
                pass

import pytest

from lru import LRUCache, memoize


def test_put_get():
    c = LRUCache(2)
    c.put("a", 1)
    assert c.get("a") == 1
    assert c.get("zz") is None
    assert c.get("zz", 7) == 7


def test_bad_capacity():
    with pytest.raises(ValueError):
        LRUCache(0)


def test_eviction_order():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.put("c", 3)
    assert "a" not in c and c.keys() == ["b", "c"] and c.evictions == 1


def test_get_refreshes():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.get("a")
    c.put("c", 3)
    assert c.keys() == ["a", "c"]


def test_contains_does_not_refresh():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert "a" in c
    c.put("c", 3)
    assert c.keys() == ["b", "c"]


def test_replace_value_refreshes_without_eviction():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.put("a", 10)
    assert len(c) == 2 and c.evictions == 0 and c.keys() == ["b", "a"] and c.get("a") == 10


def test_memoize_counts():
    calls = []

    @memoize(maxsize=8)
    def square(x):
        calls.append(x)
        return x * x

    assert [square(3), square(3), square(4)] == [9, 9, 16]
    assert calls == [3, 4]
    assert square.cache_info() == (1, 2, 2)


def test_memoize_kwargs_order():
    @memoize(maxsize=4)
    def f(a, b=0, c=0):
        return a + 10 * b + 100 * c

    assert f(1, b=2, c=3) == 321
    assert f(1, c=3, b=2) == 321
    assert f.cache_info()[0] == 1


def test_memoize_eviction():
    calls = []

    @memoize(maxsize=1)
    def ident(x):
        calls.append(x)
        return x

    ident(1), ident(2), ident(1)
    assert calls == [1, 2, 1]


def test_memoize_clear_and_metadata():
    @memoize(maxsize=2)
    def g(x):
        "double it"
        return 2 * x

    g(1), g(1)
    g.cache_clear()
    assert g.cache_info() == (0, 0, 0)
    assert g.__name__ == "g" and g.__doc__ == "double it"

import functools
from collections import OrderedDict

_MISSING = object()


class LRUCache:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.evictions = 0
        self._data = OrderedDict()

    def get(self, key, default=None):
        if key not in self._data:
            return default
        self._data.move_to_end(key)
        return self._data[key]

    def put(self, key, value):
        if key in self._data:
            self._data.move_to_end(key)
        elif len(self._data) >= self.capacity:
            self._data.popitem(last=False)
            self.evictions += 1
        self._data[key] = value

    def __len__(self):
        return len(self._data)

    def __contains__(self, key):
        return key in self._data

    def keys(self):
        return list(self._data)


def memoize(maxsize: int):
    def decorate(fn):
        cache = LRUCache(maxsize)
        stats = [0, 0]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            key = (args, tuple(sorted(kwargs.items())))
            value = cache.get(key, _MISSING)
            if value is not _MISSING:
                stats[0] += 1
                return value
            stats[1] += 1
            value = fn(*args, **kwargs)
            cache.put(key, value)
            return value

        def cache_clear():
            nonlocal cache
            cache = LRUCache(maxsize)
            stats[:] = [0, 0]

        wrapper.cache_info = lambda: (stats[0], stats[1], len(cache))
        wrapper.cache_clear = cache_clear
        return wrapper

    return decorate

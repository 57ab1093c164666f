import contextlib
import copy
import json
import os
import tempfile

_ATOMS = (type(None), bool, int, float, str)


def _check_value(value):
    if isinstance(value, _ATOMS):
        return
    if isinstance(value, list):
        for v in value:
            _check_value(v)
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for v in value.values():
            _check_value(v)
        return
    raise TypeError(f"not a JSON value: {type(value).__name__}")


class Store:
    def __init__(self, path):
        self.path = os.fspath(path)
        self._data = {}
        self._saved = None  # the committed data while a transaction runs
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                self._data = json.load(f)

    def get(self, key, default=None):
        return copy.deepcopy(self._data.get(key, default))

    def set(self, key, value):
        if not isinstance(key, str) or not key:
            raise ValueError("keys are non-empty strings")
        _check_value(value)
        self._data[key] = copy.deepcopy(value)
        self._write()

    def delete(self, key):
        if key not in self._data:
            return False
        del self._data[key]
        self._write()
        return True

    def keys(self):
        return sorted(self._data)

    def __len__(self):
        return len(self._data)

    def __contains__(self, key):
        return key in self._data

    @contextlib.contextmanager
    def transaction(self):
        if self._saved is not None:
            raise RuntimeError("transactions do not nest")
        self._saved = copy.deepcopy(self._data)
        try:
            yield self
        except BaseException:
            self._data = self._saved
            raise
        finally:
            self._saved = None
        self._write()

    def _write(self):
        if self._saved is not None:
            return
        folder = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kvstore-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self._data, f)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

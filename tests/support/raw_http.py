"""A raw HTTP POST (any body, any headers) for the hostile-proxy tests."""

from __future__ import annotations

import urllib.error
import urllib.request


def raw_post(url: str, data: bytes, key: str | None, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json",
                                                                         **(headers or {})})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()

"""Plain-HTTP calls to an engine (the embedded one or SGLang's shape), for the engine tests."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse


PROMPT = [1, 882, 198, 40, 1000, 2000, 17, 2, 198, 1, 77, 198]


def request(url: str, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None):
    """One HTTP call with exact bytes; returns (status, parsed JSON body)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    if not payload:
        return resp.status, None
    try:
        return resp.status, json.loads(payload)
    except ValueError:
        return resp.status, payload.decode()  # SGLang answers some routes in plain text


def generate(url, ids, **sp):
    rid = sp.pop("rid", None)
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
    if rid:
        body["rid"] = rid
    status, data = request(url, "POST", "/generate", body)
    assert status == 200, data
    return data


def stream_generate(url, ids, started: threading.Event | None = None, incremental=False, on_chunk=None, **sp):
    """Streamed /generate: the list of chunk objects (SSE ``data:`` events before ``[DONE]``);
    ``on_chunk()`` is called after each."""
    rid = sp.pop("rid", None)
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "stream": True}
    if rid:
        body["rid"] = rid
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    chunks, done = [], False
    for line in resp:
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            done = True
            break
        chunks.append(json.loads(line[6:]))
        if started is not None:
            started.set()
        if on_chunk is not None:
            on_chunk()
    conn.close()
    assert done, "stream ended without [DONE]"
    return chunks

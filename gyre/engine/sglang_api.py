"""SGLang's documented admin routes, as the cell agent and the coordinator use them.

Route names, request fields and answers are those of SGLang 0.5.23
(``sglang/srt/entrypoints/http_server.py`` and ``sglang/srt/managers/io_struct.py``):

| helper | route | body | SGLang's answer on success |
| --- | --- | --- | --- |
| release_memory_occupation | POST /release_memory_occupation | ReleaseMemoryOccupationReqInput ``{tags}`` | 200, ``null`` |
| resume_memory_occupation | POST /resume_memory_occupation | ResumeMemoryOccupationReqInput ``{tags}`` | 200, ``null`` |
| update_weights_from_disk | POST /update_weights_from_disk | UpdateWeightFromDiskReqInput ``{model_path, load_format, abort_all_requests, weight_version, flush_cache, ...}`` | 200 ``{success, message, num_paused_requests}``; 400 with ``success: false`` |
| abort_request | POST /abort_request | AbortReq ``{rid, abort_all}`` | 200, empty body |
| pause_generation | POST /pause_generation | PauseGenerationReqInput ``{mode: abort/retract/in_place}`` | 200 ``{message, status}`` |
| continue_generation | POST /continue_generation | ContinueGenerationReqInput | 200 ``{message, status}`` |
| flush_cache | POST /flush_cache | (none) | 200 text; 400 while requests run |
| weight_version | GET /model_info | | ``{..., weight_version}`` (0.5.23 has no /get_weight_version) |
| healthy | GET /health | | 200, empty body (503 while starting or shutting down) |

Errors come back as ``{"error": {"message": ...}}`` with 400 (``_create_error_response``).
Memory tags are SGLang's ``GPU_MEMORY_TYPE_*`` constants: ``kv_cache``, ``weights``, ``cuda_graph``.

Synchronous on purpose (stdlib urllib, no session): admin calls are rare and the cell agent is a
synchronous loop; async code calls them through ``asyncio.to_thread``. The engine's own in-flight
count is not part of SGLang's API: drains read the router's per-engine count instead.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from gyre.engine.backends.base import EngineAdmin, EngineAdminError
from gyre.engine.client import error_message

MEMORY_TAGS = ("kv_cache", "weights")     # what a role switch releases (cuda_graph stays)
PAUSE_MODES = ("abort", "retract", "in_place")


class SGLangAPIError(EngineAdminError):
    """A route answered non-2xx (``status``) or could not be reached (``status`` None)."""


class SGLangAdmin(EngineAdmin):
    """SGLang's admin routes; also the embedded engine's, which serves the same subset.

    ``memory_saver`` False (SGLang started without ``--enable-memory-saver``, i.e. not on CUDA):
    a role switch cannot free memory; :meth:`release_memory` pauses generation (aborting what
    runs) and :meth:`resume_memory` continues it."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 120.0, memory_saver: bool = True):
        self.memory_saver = memory_saver
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _call(self, method: str, route: str, body: dict | None = None, timeout_s: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers, **({"Content-Type": "application/json"} if data is not None else {}))
        req = urllib.request.Request(self.url + route, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise SGLangAPIError(e.code, _message(e.read(), e.reason), route) from None
        except (OSError, TimeoutError) as e:
            raise SGLangAPIError(None, f"{type(e).__name__}: {e}", route) from None
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode("utf-8", "replace")   # e.g. /flush_cache answers plain text

    # --- memory ---------------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | tuple[str, ...] | None = MEMORY_TAGS) -> None:
        """Free GPU memory (needs ``--enable-memory-saver``); SGLang refuses while requests run.
        Released weights are gone: load weights again after a resume."""
        self._call("POST", "/release_memory_occupation", {"tags": None if tags is None else list(tags)})

    def resume_memory_occupation(self, tags: list[str] | tuple[str, ...] | None = MEMORY_TAGS) -> None:
        self._call("POST", "/resume_memory_occupation", {"tags": None if tags is None else list(tags)})

    # --- weights ----------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                 abort_all_requests: bool = False, load_format: str | None = None) -> dict:
        """Load weights from a directory on a filesystem every node of the engine sees."""
        body: dict = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        answer = self._call("POST", "/update_weights_from_disk", body)
        if isinstance(answer, dict) and answer.get("success") is False:  # defensive: SGLang sends 400 then
            raise SGLangAPIError(400, str(answer.get("message", "")), "/update_weights_from_disk")
        return answer if isinstance(answer, dict) else {}

    def weight_version(self) -> str:
        info = self._call("GET", "/model_info")
        if not isinstance(info, dict) or "weight_version" not in info:
            raise SGLangAPIError(200, f"no weight_version in {info!r:.200}", "/model_info")
        return str(info["weight_version"])

    # --- requests ---------------------------------------------------------------------------
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        if rid is None and not abort_all:
            raise ValueError("give rid or abort_all=True")
        body: dict = {"abort_all": True} if abort_all else {"rid": rid}
        self._call("POST", "/abort_request", body)

    def pause_generation(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: choose one of {', '.join(PAUSE_MODES)}")
        self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", {})

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache")

    # --- the EngineAdmin contract (what the cell agent calls) ----------------------------------
    def abort_all(self) -> None:
        self.abort_request(abort_all=True)

    def release_memory(self) -> None:
        if self.memory_saver:
            self.release_memory_occupation(MEMORY_TAGS)
        else:
            self.pause_generation("abort")

    def resume_memory(self) -> None:
        if self.memory_saver:
            self.resume_memory_occupation(MEMORY_TAGS)
        else:
            self.continue_generation()

    def load_weights(self, weights_dir: str, version: str) -> None:
        """``/update_weights_from_disk`` without aborting: SGLang holds running requests while it
        loads and continues them on the new weights; its ``flush_cache`` (default on) resets the
        radix cache."""
        self.update_weights_from_disk(str(weights_dir), str(version))

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            self._call("GET", "/health", timeout_s=timeout_s)
            return True
        except SGLangAPIError:
            return False


def _message(raw: bytes, default: str) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:500].decode("utf-8", "replace") or str(default)
    return error_message(data, str(default))

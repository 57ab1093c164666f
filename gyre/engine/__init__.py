"""gyre.engine: the SGLang HTTP client, the router over rollout endpoints, and the embedded engine.

Modules (imported on use, so ``gyre --help`` stays fast):

* ``client``: :class:`EngineClient` for SGLang's RL HTTP subset (SGLang or the embedded engine).
* ``router``: :class:`Router`, per-execution affinity over elastic endpoints, retries.
* ``server``, ``runtime``, ``qwen``, ``sampling``, ``prefix_cache``: the embedded engine
  (``gyre engine``, entry point ``cli``); ``launch`` starts one for tests and benchmarks.
"""

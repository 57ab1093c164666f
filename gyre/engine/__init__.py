"""gyre.engine: the SGLang HTTP client, the router over rollout endpoints, and the embedded engine.

Modules (imported on use, so ``gyre --help`` stays fast):

* ``client``: :class:`EngineClient` for SGLang's RL HTTP subset (SGLang or the embedded engine).
* ``router``: :class:`Router`, per-execution affinity over elastic endpoints, retries.
* ``server``, ``runtime``, ``qwen``, ``sampling``, ``prefix_cache``: the embedded engine
  (``gyre engine``, entry point ``cli``).
* ``launch``: the one engine seam (``start_cell_engine``), which asks ``backends`` (THE table:
  one module per ``engine.backend``: ``embedded``, ``sglang``, ``vllm`` with its wire
  ``vllm_wire``) for the launch line, wire and admin; ``process``: engine processes (start, health,
  stop, the Slurm step); ``sglang_launch``/``sglang_api``: SGLang's command lines and admin routes;
  ``sglang_standin``: SGLang's launcher without GPUs; ``reaper``: processes a killed run left
  behind; ``pace``: benchmarks' pace.

Model directories, identity and the tiny model live in gyre.model.
"""

"""Development tooling: what tests, benches and the CPU dev stack run, never imported by a service.

Modules by role: ``dev_server/`` (the CPU dev engine speaking SGLang's protocol, ``hindsight-dev-engine``),
``tiny_model.py`` and ``tiny_tool_model.py`` (offline tiny Qwen3 models), ``tiny_model_cli.py``
(``hindsight-tiny-model``), ``model_cache.py`` (the build-once cache of those models), ``engine_procs.py`` (start
the dev engine and sglang-router as local processes), ``pgcluster.py`` (a throwaway PostgreSQL cluster).
"""

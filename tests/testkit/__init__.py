"""The test kit: how tests and benches start the real services and talk to them.

- ``tests.testkit.procs``: engines, routers and any server process, each in its own process group and
  killed by the kernel if this process dies (pytest interrupted or ``kill -9``), so a run leaves nothing.
- ``tests.testkit.servers``: the test keys, ``start_judge``, ``start_policy`` (and ``start_judged_policy``,
  ``start_prm_policy``, ``start_openai_judge``, ...), ``judged_policy_stack`` and
  the HTTP helpers (``client``, ``admin``, ``chat``, ``stats``, ``lease_all``, ``samples_of``).
- ``tests.testkit.stack``: the whole stack (engine, rules judge, policy server), a scripted user, and the
  trickle closed loop with the trainer.
- ``tests.testkit.local_source``: an in-process sample source on the current weights (trainer tests).
- ``tests.testkit.trainer_cli``: ``hindsight-train`` as a process, alone or under torchrun.
- ``tests.testkit.records``: small stored records for store-level tests.
- ``tests.testkit.openclaw``: the real OpenClaw (binaries, one agent turn) and the dev stack it talks to.
- ``tests.testkit.openai_stub``: an OpenAI-compatible endpoint without ``n`` or constraints (judge tests), and its starter.
- ``tests.testkit.postgres``: the throwaway PostgreSQL cluster of the store tests.
- ``tests.testkit.store_lock``: another process holding a SQLite store's write lock.
- ``tests.testkit.chromium``: headless Chromium over the DevTools protocol (what a report page rendered).

No test module outside this package starts a process itself (tests/unit/test_servers_start_in_testkit.py).

Importable as ``tests.testkit`` from the repository root: pytest puts the root on ``sys.path``
(``pythonpath`` in pyproject.toml) and benches run as modules (``python -m bench.NAME``).
"""

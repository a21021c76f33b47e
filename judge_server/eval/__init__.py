"""``hindsight-judge-eval``: step-level judge quality on process-labelled agent trajectories (docs/JUDGE_EVAL.md).

Modules by role: ``dataset`` (rows -> typed labelled steps, each a (turn, next_state) pair; prediction files),
``metrics`` (pure scoring functions), ``guard_stats`` (the deterministic guards measured offline), ``run`` (the HTTP
client side: every step through a running judge's ``POST /v1/judge``, cached per step), ``report`` (table, JSON,
HTML) and ``cli`` (the console script).
"""

"""Adapters that let an RL framework other than our trainer train on leased Hindsight samples.

Each module imports its framework at import time and runs only where that framework is installed
(never in the project's own environment): :mod:`.verl_rollout` for verl. docs/TRAINERS.md says which
adapter was tested against which framework version, and which extension points are not verified.
"""

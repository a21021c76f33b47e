#!/usr/bin/env bash
# Build (or reuse) the separate venv in which verl 0.9.1 imports on CPU, for the verl adapter test
# (tests/conformance/test_verl_adapter.py). Never part of the project venv: verl brings Ray, datasets,
# wandb and pins transformers < 5.11.
#
#   bash tests/conformance/make_verl_venv.sh      # prints the venv's python on success
#
# Where: ${HINDSIGHT_VERL_VENV:-$HOME/.cache/hindsight/verl-0.9.1}. Reused when its marker file `.complete`
# exists (written only after the import check below passed), so a half-built venv is rebuilt.
# On failure the reason goes to "$VENV.failed" (read by the test to skip with it) and the exit status is 1.
# Cost measured here: 487 s and 1.9 GB for a fresh build on the 2-core machine under load; seconds when reused.
# verl's base requirements name no torch; its extras pin a CUDA torch 2.11. The venv gets the same CPU torch
# as the project (torch==2.13.0, the +cpu wheel on these machines), installed first so that verl's
# torch-using dependencies (accelerate, peft, tensordict, torchdata) keep it instead of pulling a CUDA build.
set -euo pipefail

VENV="${HINDSIGHT_VERL_VENV:-$HOME/.cache/hindsight/verl-0.9.1}"
PYTHON="${HINDSIGHT_VERL_BASE_PYTHON:-python3}"
# The lease client's own dependencies (it is imported from the repo by PYTHONPATH, not installed).
CLIENT_DEPS=(httpx==0.28.1 "tenacity>=9,<10" "pydantic>=2.7,<3")
# What verl's agent-loop module imports beyond its base requirements (they sit in its verl-core extra,
# which also pulls GPU-only packages).
AGENT_LOOP_DEPS=(cachetools "fastapi>=0.115,<1" "uvicorn>=0.30,<1")
CHECK='from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, AgentLoopManager
from verl.trainer.ppo import core_algos
import verl; assert verl.__version__ == "0.9.1", verl.__version__'

NAME=make_verl_venv
# shellcheck source=tests/conformance/venv_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv_lib.sh"
reuse_or_create
"$VENV/bin/pip" install -q torch==2.13.0 || fail "pip install torch==2.13.0 (CPU) failed"
"$VENV/bin/pip" install -q verl==0.9.1 torch==2.13.0 "${CLIENT_DEPS[@]}" "${AGENT_LOOP_DEPS[@]}" || fail "pip install verl==0.9.1 failed"
finish "verl 0.9.1 does not import in $VENV"

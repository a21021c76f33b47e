#!/usr/bin/env bash
# Build (or reuse) the separate venv in which SGLang 0.5.23's own request classes import on CPU, for the
# SGLang conformance test (tests/conformance/test_sglang_conformance.py). Never part of the project venv:
# sglang pins torch 2.14.1 and a CUDA stack the project does not use.
#
#   bash tests/conformance/make_sglang_venv.sh      # prints the venv's python on success
#
# Where: ${HINDSIGHT_SGLANG_VENV:-$HOME/.cache/hindsight/sglang-0.5.23}. Reused when its marker file
# `.complete` exists (written only after the import check below passed), so a half-built venv is rebuilt.
# On failure the reason goes to "$VENV.failed" (read by the test to skip with it) and the exit status is 1.
# Cost measured on the CI kind of machine: 4-7 minutes (7 with tests running beside it) and 6 GB for a fresh
# build (torch 2.14.1 comes with its CUDA wheels from the registry); about 30 s when reused (the import check).
set -euo pipefail

VENV="${HINDSIGHT_SGLANG_VENV:-$HOME/.cache/hindsight/sglang-0.5.23}"
PYTHON="${HINDSIGHT_SGLANG_BASE_PYTHON:-python3}"
# sglang is installed without its dependencies (most are GPU kernels); these are what its request
# classes (io_struct, sampling_params, api_contract) import, torch at the version sglang pins.
DEPS=(torch==2.14.1 torchvision==0.29.1 msgspec pyzmq psutil pybase64 triton pillow aiohttp openai dill
      apache-tvm-ffi sentencepiece compressed-tensors gguf partial-json-parser ipython orjson starlette)
CHECK='from sglang.srt.managers.io_struct import GenerateReqInput, AbortReq
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.entrypoints.api_contract import generate_contract_error
import sglang; assert sglang.__version__ == "0.5.23", sglang.__version__'

NAME=make_sglang_venv
# shellcheck source=tests/conformance/venv_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv_lib.sh"
reuse_or_create
"$VENV/bin/pip" install -q --no-deps sglang==0.5.23 || fail "pip install --no-deps sglang==0.5.23 failed"
# pip's resolver warns that sglang's own pins are not all met (we skip its GPU dependencies): expected.
"$VENV/bin/pip" install -q "${DEPS[@]}" || fail "pip install of sglang's import dependencies failed"
finish "sglang 0.5.23 request classes do not import in $VENV"

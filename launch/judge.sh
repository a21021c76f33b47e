#!/usr/bin/env bash
# launch/judge.sh: the judge on its GPUs. Starts N SGLang judge engines on PRM_GPUS (PRM_TP GPUs each,
# pinned with CUDA_VISIBLE_DEVICES), waits for each /health, puts one sglang-router in front (waits on
# /readiness), then hindsight-judge pointed at the router (waits on /ready), and stays in the
# foreground; Ctrl-C or any process exiting stops exactly the processes it started.
#
#   PRM_MODEL_PATH=/models/Qwen3-4B launch/judge.sh [--dry-run] [VAR=VALUE ...]
#
# Every setting is an environment variable with a default (docs/LAUNCH.md has the table).
# run.sh sources this file and calls judge_start; executed directly it runs judge_main.
set -euo pipefail
HS_LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$HS_LAUNCH_DIR/common.sh"

judge_defaults() {
  : "${PRM_MODEL_PATH:=${HF_CKPT:-}}"    # judge / OPD-teacher model (default: the policy checkpoint)
  : "${PRM_GPUS:=0,1}"                   # GPU ids for judge engines
  : "${PRM_TP:=2}"                       # GPUs per judge engine (tensor parallel)
  : "${PRM_MEM_FRACTION:=0.85}"
  : "${PRM_CONTEXT_LENGTH:=32768}"
  : "${PRM_SGLANG_ARGS:=}"               # extra sglang.launch_server flags
  : "${JUDGE_ENGINE_BASE_PORT:=31100}"   # engine i listens on base + i
  : "${JUDGE_ROUTER_PORT:=30201}"
  : "${JUDGE_ROUTER_METRICS_PORT:=29201}"
  : "${JUDGE_PORT:=30200}"               # hindsight-judge
  : "${JUDGE_API_KEY:=}"                 # bearer clients must send to hindsight-judge
  : "${JUDGE_ARGS:=}"                    # extra hindsight-judge flags
  : "${HINDSIGHT_JUDGE_BIN:=hindsight-judge}"
}

judge_validate() {
  [[ -n $PRM_MODEL_PATH ]] || hs_die "PRM_MODEL_PATH (or HF_CKPT) is not set: the judge model folder or hub id"
  hs_engine_count PRM_GPUS "$PRM_GPUS" "$PRM_TP" >/dev/null || exit 2
  hs_require_keys_if_public "$HOST" JUDGE_API_KEY ENGINE_API_KEY
}

judge_start() {
  hs_start_engines prm "$PRM_MODEL_PATH" "$PRM_GPUS" "$PRM_TP" "$JUDGE_ENGINE_BASE_PORT" \
    "--mem-fraction-static $PRM_MEM_FRACTION --context-length $PRM_CONTEXT_LENGTH --served-model-name judge $PRM_SGLANG_ARGS"
  hs_start_router judge-router "$JUDGE_ROUTER_PORT" "$JUDGE_ROUTER_METRICS_PORT" "${HS_ENGINE_URLS[@]}"
  local router_url="http://$HS_CONNECT_HOST:$JUDGE_ROUTER_PORT" url="http://$HS_CONNECT_HOST:$JUDGE_PORT"
  local -a env=() cmd extra
  # Keys travel in the environment (HINDSIGHT_JUDGE_*), not argv, so `ps` does not show them.
  [[ -z $JUDGE_API_KEY ]] || env+=("HINDSIGHT_JUDGE_API_KEY=$JUDGE_API_KEY")
  [[ -z $ENGINE_API_KEY ]] || env+=("HINDSIGHT_JUDGE_ENGINE_API_KEY=$ENGINE_API_KEY")
  read -r -a extra <<<"$JUDGE_ARGS"
  cmd=("$HINDSIGHT_JUDGE_BIN" --engine-url "$router_url" --host "$HOST" --port "$JUDGE_PORT" "${extra[@]}")
  hs_spawn judge "${env[@]}" -- "${cmd[@]}"
  hs_wait_http judge "$url/ready" "$SERVICE_READY_TIMEOUT_S"
}

judge_main() {
  HS_USAGE=$(sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//')
  hs_parse_args "$@"
  hs_common_defaults
  judge_defaults
  judge_validate
  hs_prepare_run_dir
  hs_install_trap
  judge_start
  hs_supervise
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then judge_main "$@"; fi

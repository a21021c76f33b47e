#!/usr/bin/env bash
# launch/policy.sh: the policy side. Starts SGLang policy engines on ROLLOUT_GPUS (ROLLOUT_TP GPUs each)
# behind an sglang-router, then hindsight-policy (the OpenAI-compatible proxy agents talk to) pointed
# at the router, the judge (JUDGE_URL) and the teacher (TEACHER_URL), and stays in the foreground;
# Ctrl-C or any process exiting stops exactly the processes it started. POLICY_REPLICAS=N starts N
# hindsight-policy replicas on ports POLICY_PORT + i*POLICY_REPLICA_PORT_STEP sharing STORE_URL
# (postgresql://...; put any HTTP load balancer in front of them, docs/SCALING.md).
#
#   HF_CKPT=/models/Qwen3-4B MODE=rl launch/policy.sh [--dry-run] [VAR=VALUE ...]
#
# Every setting is an environment variable with a default (docs/LAUNCH.md has the table).
# run.sh sources this file and calls policy_start; executed directly it runs policy_main.
set -euo pipefail
HS_LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$HS_LAUNCH_DIR/common.sh"

policy_defaults() {
  : "${POLICY_MODEL_PATH:=${HF_CKPT:-}}" # policy checkpoint (tokenizer + chat template too)
  : "${ROLLOUT_GPUS:=0,1}"               # GPU ids for policy engines
  : "${ROLLOUT_TP:=2}"                   # GPUs per policy engine
  : "${ROLLOUT_MEM_FRACTION:=0.85}"
  : "${ROLLOUT_CONTEXT_LENGTH:=32768}"
  : "${ROLLOUT_SGLANG_ARGS:=}"           # extra sglang.launch_server flags
  : "${POLICY_ENGINE_BASE_PORT:=31000}"
  : "${POLICY_ROUTER_PORT:=30001}"
  : "${POLICY_ROUTER_METRICS_PORT:=29001}"
  : "${POLICY_PORT:=30000}"              # hindsight-policy: point agents at http://HOST:POLICY_PORT/v1
  : "${POLICY_API_KEY:=}"                # bearer agents send
  : "${POLICY_ADMIN_API_KEY:=}"          # bearer of the trainer / admin endpoints
  : "${SERVED_MODEL_NAME:=hindsight-policy}"  # the model name agents send; given to the engines AND the server so they agree
  : "${MODE:=}"                          # rl | opd | combine; empty: the server's default (switch: POST /admin/mode)
  : "${W_RL:=}"                          # empty: the server's default
  : "${W_OPD:=}"                         # empty: the server's default
  : "${JUDGE_PORT:=30200}"
  : "${JUDGE_ROUTER_PORT:=30201}"
  : "${JUDGE_URL:=http://$HS_CONNECT_HOST:$JUDGE_PORT}"
  : "${TEACHER_URL:=http://$HS_CONNECT_HOST:$JUDGE_ROUTER_PORT}"  # OPD teacher: the judge engines' router
  : "${JUDGE_API_KEY:=}"
  : "${POLICY_DATA_DIR:=$HS_RUN_DIR/data}"
  : "${POLICY_REPLICAS:=1}"              # hindsight-policy processes sharing STORE_URL
  : "${POLICY_REPLICA_PORT_STEP:=10}"    # replica i listens on POLICY_PORT + i*STEP (30000, 30010, ...)
  : "${STORE_URL:=}"                     # empty: SQLite under POLICY_DATA_DIR; postgresql://... for replicas
  : "${POLICY_ARGS:=}"                   # extra hindsight-policy flags
  : "${HINDSIGHT_POLICY_BIN:=hindsight-policy}"
}

policy_validate() {
  [[ -n $POLICY_MODEL_PATH ]] || hs_die "HF_CKPT (or POLICY_MODEL_PATH) is not set: the policy model folder"
  [[ -z $MODE || $MODE == rl || $MODE == opd || $MODE == combine ]] || hs_die "MODE='$MODE': use rl, opd or combine"
  hs_engine_count ROLLOUT_GPUS "$ROLLOUT_GPUS" "$ROLLOUT_TP" >/dev/null || exit 2
  hs_require_keys_if_public "$HOST" POLICY_API_KEY POLICY_ADMIN_API_KEY ENGINE_API_KEY
  [[ $POLICY_REPLICAS =~ ^[1-9][0-9]*$ ]] || hs_die "POLICY_REPLICAS='$POLICY_REPLICAS': use a positive integer"
  if (( POLICY_REPLICAS > 1 )) && [[ $STORE_URL != postgresql://* && $STORE_URL != postgres://* ]]; then
    hs_die "POLICY_REPLICAS=$POLICY_REPLICAS needs STORE_URL=postgresql://... (replicas share one PostgreSQL store)"
  fi
  local i p
  for (( i = 0; i < POLICY_REPLICAS; i++ )); do
    p=$((POLICY_PORT + i * POLICY_REPLICA_PORT_STEP))
    if (( p == POLICY_ROUTER_PORT || p == JUDGE_PORT || p == JUDGE_ROUTER_PORT )); then
      hs_die "policy replica $i would listen on port $p, taken by another service: change POLICY_REPLICA_PORT_STEP"
    fi
  done
}

policy_start() {
  hs_start_engines rollout "$POLICY_MODEL_PATH" "$ROLLOUT_GPUS" "$ROLLOUT_TP" "$POLICY_ENGINE_BASE_PORT" \
    "--mem-fraction-static $ROLLOUT_MEM_FRACTION --context-length $ROLLOUT_CONTEXT_LENGTH --served-model-name $SERVED_MODEL_NAME $ROLLOUT_SGLANG_ARGS"
  local workers
  workers=$(IFS=','; echo "${HS_ENGINE_URLS[*]}")
  hs_start_router policy-router "$POLICY_ROUTER_PORT" "$POLICY_ROUTER_METRICS_PORT" "${HS_ENGINE_URLS[@]}"
  local -a env=() cmd extra
  [[ -z $POLICY_API_KEY ]] || env+=("HINDSIGHT_POLICY_API_KEY=$POLICY_API_KEY")
  [[ -z $POLICY_ADMIN_API_KEY ]] || env+=("HINDSIGHT_POLICY_ADMIN_API_KEY=$POLICY_ADMIN_API_KEY")
  [[ -z $ENGINE_API_KEY ]] || env+=("HINDSIGHT_POLICY_ENGINE_API_KEY=$ENGINE_API_KEY")
  [[ -z $JUDGE_API_KEY ]] || env+=("HINDSIGHT_POLICY_JUDGE_API_KEY=$JUDGE_API_KEY")
  # The default teacher is the judge engines' router, guarded by the engine key.
  [[ -z $ENGINE_API_KEY ]] || env+=("HINDSIGHT_POLICY_TEACHER_API_KEY=$ENGINE_API_KEY")
  [[ -z $STORE_URL ]] || env+=("HINDSIGHT_POLICY_STORE_URL=$STORE_URL")
  read -r -a extra <<<"$POLICY_ARGS"
  local i port name
  for (( i = 0; i < POLICY_REPLICAS; i++ )); do
    port=$((POLICY_PORT + i * POLICY_REPLICA_PORT_STEP))
    name=policy; (( i == 0 )) || name=policy-$i
    # Weight updates go to every engine directly (--engine-worker-urls), generation through the router.
    cmd=("$HINDSIGHT_POLICY_BIN" --model-path "$POLICY_MODEL_PATH"
      --engine-url "http://$HS_CONNECT_HOST:$POLICY_ROUTER_PORT" --engine-worker-urls "$workers"
      --judge-url "$JUDGE_URL" --teacher-url "$TEACHER_URL" --data-dir "$POLICY_DATA_DIR"
      --served-model-name "$SERVED_MODEL_NAME" --host "$HOST" --port "$port")
    hs_add_flag cmd --mode "$MODE"
    hs_add_flag cmd --w-rl "$W_RL"
    hs_add_flag cmd --w-opd "$W_OPD"
    (( POLICY_REPLICAS == 1 )) || cmd+=(--replica-id "$name")
    hs_spawn "$name" "${env[@]}" -- "${cmd[@]}" "${extra[@]}"
  done
  for (( i = 0; i < POLICY_REPLICAS; i++ )); do
    name=policy; (( i == 0 )) || name=policy-$i
    hs_wait_http "$name" "http://$HS_CONNECT_HOST:$((POLICY_PORT + i * POLICY_REPLICA_PORT_STEP))/ready" \
      "$SERVICE_READY_TIMEOUT_S"
  done
}

policy_main() {
  HS_USAGE=$(sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//')
  hs_parse_args "$@"
  hs_common_defaults
  policy_defaults
  policy_validate
  hs_prepare_run_dir
  hs_install_trap
  policy_start
  hs_supervise
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then policy_main "$@"; fi

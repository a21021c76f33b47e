#!/usr/bin/env bash
# launch/trainer.sh: the trainer. Runs `torchrun` on ACTOR_GPUS (one rank per GPU) executing
# trainer.cli (hindsight-train): lease samples from the policy server, PPO update, save a checkpoint,
# ack, and ask the policy server to load the new weights. Exits with the trainer's status;
# Ctrl-C stops exactly the processes it started.
#
#   HF_CKPT=/models/Qwen3-4B POLICY_ADMIN_API_KEY=... launch/trainer.sh [--dry-run] [VAR=VALUE ...]
#
# Every setting is an environment variable (docs/LAUNCH.md has the table); a TRAIN_* knob left empty
# passes no flag, so hindsight-train's own default applies. The admin key travels in the environment.
# run.sh sources this file and calls trainer_start; executed directly it runs trainer_main.
set -euo pipefail
HS_LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$HS_LAUNCH_DIR/common.sh"

trainer_defaults() {
  : "${ACTOR_MODEL_PATH:=${HF_CKPT:-}}"  # checkpoint the trainer starts from
  : "${ACTOR_GPUS:=0,1,2,3}"             # GPU ids, one torchrun rank each
  : "${POLICY_PORT:=30000}"
  : "${POLICY_URL:=http://$HS_CONNECT_HOST:$POLICY_PORT}"
  : "${POLICY_ADMIN_API_KEY:=}"
  : "${TRAIN_OUT_DIR:=$HS_RUN_DIR/checkpoints}"  # step_XXXXXX folders; engines load them from here
  : "${TRAIN_STEPS:=}"                   # empty: run until stopped (--steps 0)
  : "${TRAIN_BATCH_SIZE:=}"              # empty: hindsight-train's default
  : "${TRAIN_LR:=}"                      # empty: hindsight-train's default
  : "${TRAIN_ARGS:=}"                    # extra hindsight-train flags
  : "${TORCHRUN:=torchrun}"
}

trainer_validate() {
  [[ -n $ACTOR_MODEL_PATH ]] || hs_die "HF_CKPT (or ACTOR_MODEL_PATH) is not set: the checkpoint to train"
  hs_gpu_count ACTOR_GPUS "$ACTOR_GPUS" >/dev/null || exit 2
  [[ -z $TRAIN_STEPS || $TRAIN_STEPS =~ ^[1-9][0-9]*$ ]] || hs_die "TRAIN_STEPS='$TRAIN_STEPS' must be a positive integer"
}

trainer_start() {
  local nproc
  nproc=$(hs_gpu_count ACTOR_GPUS "$ACTOR_GPUS") || exit 2
  local -a cmd extra env=("CUDA_VISIBLE_DEVICES=${ACTOR_GPUS// /}")
  read -r -a extra <<<"$TRAIN_ARGS"
  # The admin key goes in the environment: argv is readable by every user of the node (ps).
  [[ -z $POLICY_ADMIN_API_KEY ]] || env+=("HINDSIGHT_TRAIN_ADMIN_API_KEY=$POLICY_ADMIN_API_KEY")
  cmd=("$TORCHRUN" --standalone --nnodes 1 --nproc-per-node "$nproc" -m trainer.cli
    --policy-url "$POLICY_URL" --model-path "$ACTOR_MODEL_PATH" --out-dir "$TRAIN_OUT_DIR"
    --steps "${TRAIN_STEPS:-0}")
  hs_add_flag cmd --batch-size "$TRAIN_BATCH_SIZE"
  hs_add_flag cmd --lr "$TRAIN_LR"
  cmd+=("${extra[@]}")
  hs_spawn trainer "${env[@]}" -- "${cmd[@]}"
}

trainer_main() {
  HS_USAGE=$(sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//')
  hs_parse_args "$@"
  hs_common_defaults
  trainer_defaults
  trainer_validate
  hs_prepare_run_dir
  hs_install_trap
  trainer_start
  hs_supervise
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then trainer_main "$@"; fi

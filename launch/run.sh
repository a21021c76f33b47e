#!/usr/bin/env bash
# launch/run.sh: the whole loop on one node. Judge engines + router + hindsight-judge on PRM_GPUS,
# policy engines + router + hindsight-policy on ROLLOUT_GPUS, then the trainer (torchrun) on
# ACTOR_GPUS; stays in the foreground and stops exactly what it started on Ctrl-C or when any
# process exits. The default split is an 8-GPU one: trainer 4, policy 2, judge 2.
#
#   HF_CKPT=/models/Qwen3-4B launch/run.sh MODE=rl|opd|combine [--dry-run] [VAR=VALUE ...]
#
# GPU lists are device ids (ACTOR_GPUS=0,1,2,3), not counts; they must lie in 0..NUM_GPUS-1 and
# must not overlap. Every setting is an environment variable with a default (docs/LAUNCH.md).
set -euo pipefail
HS_LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/judge.sh
source "$HS_LAUNCH_DIR/judge.sh"
# shellcheck source=launch/policy.sh
source "$HS_LAUNCH_DIR/policy.sh"
# shellcheck source=launch/trainer.sh
source "$HS_LAUNCH_DIR/trainer.sh"

run_main() {
  HS_USAGE=$(sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//')
  hs_parse_args "$@"
  hs_common_defaults
  : "${ACTOR_GPUS:=0,1,2,3}"
  : "${ROLLOUT_GPUS:=4,5}"
  : "${PRM_GPUS:=6,7}"
  judge_defaults
  policy_defaults
  trainer_defaults
  # One node, one set of keys: the trainer authenticates with the policy server's admin key.
  hs_require_keys_if_public "$HOST" POLICY_ADMIN_API_KEY
  [[ -n $POLICY_ADMIN_API_KEY ]] || hs_log "POLICY_ADMIN_API_KEY is empty: admin endpoints are open on $HOST"
  judge_validate
  policy_validate
  trainer_validate
  hs_check_disjoint ACTOR_GPUS ROLLOUT_GPUS
  hs_check_disjoint ACTOR_GPUS PRM_GPUS
  hs_check_disjoint ROLLOUT_GPUS PRM_GPUS
  local used=$(( $(hs_gpu_count ACTOR_GPUS "$ACTOR_GPUS") + $(hs_gpu_count ROLLOUT_GPUS "$ROLLOUT_GPUS") \
    + $(hs_gpu_count PRM_GPUS "$PRM_GPUS") ))
  (( used <= NUM_GPUS )) || hs_die "the split uses $used GPUs but NUM_GPUS=$NUM_GPUS"
  hs_log "MODE=${MODE:-default}; trainer on $ACTOR_GPUS, policy on $ROLLOUT_GPUS (tp $ROLLOUT_TP), judge on $PRM_GPUS (tp $PRM_TP); run dir $HS_RUN_DIR"
  hs_prepare_run_dir
  hs_install_trap
  judge_start
  # The policy server reaches the judge and teacher just started (unless the operator points elsewhere).
  policy_start
  trainer_start
  hs_supervise
}

run_main "$@"

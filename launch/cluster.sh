#!/usr/bin/env bash
# launch/cluster.sh: docs/SCALING.md's multi-host layout on ONE machine, each "host" on its own loopback
# address (127.0.0.11, .12, ...): PostgreSQL; 3 policy replicas and 2 judge servers behind HAProxy (/ready
# health checks); 2 policy dev engines and 2 judge engines, each pair behind a real sglang-router; a 2-rank
# torchrun trainer. Tiny CPU models, as launch/dev.sh (launch/cluster.py has the contract).
#
#   launch/cluster.sh start    start everything; return once ready (endpoints in $HINDSIGHT_RUN_DIR/endpoints.json)
#   launch/cluster.sh status   what runs, from the PID file
#   launch/cluster.sh stop     stop exactly what `start` started (PIDs in $HINDSIGHT_RUN_DIR/pids.json, then
#                              PostgreSQL by pg_ctl on its own data dir)
#
# HINDSIGHT_RUN_DIR (default .hindsight/cluster). Needs Debian's haproxy and postgresql packages; PYTHON picks
# the interpreter. HINDSIGHT_CLUSTER_TRAINER=0 leaves the trainer out.
set -euo pipefail
HS_LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export HINDSIGHT_RUN_DIR=${HINDSIGHT_RUN_DIR:-.hindsight/cluster}
# shellcheck source=launch/local_env.sh
source "$HS_LAUNCH_DIR/local_env.sh"

usage() { sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

case "${1:-}" in
  start|stop|status)
    [[ $# -eq 1 ]] || { usage >&2; exit 2; }
    exec "$PYTHON" "$HS_LAUNCH_DIR/cluster.py" "$1" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac

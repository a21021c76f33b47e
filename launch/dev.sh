#!/usr/bin/env bash
# launch/dev.sh: the one-command CPU dev stack on 127.0.0.1 (tiny models, dev engines behind real
# sglang-routers, hindsight-judge, hindsight-policy) and the end-to-end demo.
#
#   launch/dev.sh start    [MODE=rl|opd|combine] [JUDGE_BACKEND=llm|openai|rules]  start; return once ready
#   launch/dev.sh demo     start if needed, drive a scripted agent conversation (with a tool call)
#                          through the openai client, show judge votes, samples, one training step
#                          and the weight update
#   launch/dev.sh openclaw write an OpenClaw config pointing at the running stack (docs/CLIENTS.md;
#                          HINDSIGHT_OPENCLAW_GATEWAY_PORT=N also configures its gateway)
#   launch/dev.sh status   what runs, from the PID file
#   launch/dev.sh stop     stop exactly what `start` started (PIDs in $HINDSIGHT_RUN_DIR/pids.json)
#
# HINDSIGHT_RUN_DIR (default .hindsight/dev) holds models/, logs/, data/, checkpoints/, pids.json and
# endpoints.json (URLs and API keys for scripts and other tools). PYTHON picks the interpreter.
# HINDSIGHT_DEV_STOP_WITH_PID=<pid> at start: the stack stops itself once that process is gone.
set -euo pipefail
HS_LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export HINDSIGHT_RUN_DIR=${HINDSIGHT_RUN_DIR:-.hindsight/dev}
# MODE and JUDGE_BACKEND pass through when set; unset, the services' own defaults apply.
# shellcheck source=launch/local_env.sh
source "$HS_LAUNCH_DIR/local_env.sh"

usage() { sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

cmd=${1:-}
[[ $# -gt 0 ]] && shift
for arg in "$@"; do
  case "$arg" in
    [A-Z_]*=*) export "${arg?}" ;;
    --dry-run) printf 'error: dev.sh has no dry run; it only starts processes on 127.0.0.1\n' >&2; exit 2 ;;
    *) printf "error: unknown argument '%s'\n" "$arg" >&2; usage >&2; exit 2 ;;
  esac
done

case "$cmd" in
  start|stop|status) exec "$PYTHON" "$HS_LAUNCH_DIR/devstack.py" "$cmd" ;;
  demo) exec "$PYTHON" "$HS_LAUNCH_DIR/demo.py" ;;
  openclaw) exec "$PYTHON" "$HS_LAUNCH_DIR/openclaw.py" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac

# shellcheck shell=bash
# Shared helpers for the Hindsight GPU launch scripts (judge.sh, policy.sh, trainer.sh, run.sh).
# Sourced, never executed. Contract:
#   - hs_spawn starts one process in its own session (setsid) so that stopping it also stops the
#     children it forks (SGLang schedulers, torchrun ranks); its PID goes to HS_PIDS and
#     $HS_RUN_DIR/pids/NAME.pid, its output to $HS_RUN_DIR/logs/NAME.log.
#   - hs_cleanup (installed by hs_install_trap) stops only the process groups in HS_PIDS:
#     SIGTERM, then SIGKILL after HS_STOP_GRACE_S. Nothing is ever killed by name. It runs to the end
#     even when nobody reads the script's output any more (a closed terminal or pipe), and a stop
#     signal during a readiness wait or the supervision is handled within HS_WAKE_S seconds, not when
#     the wait's deadline passes or a service exits.
#   - With HS_DRY_RUN=1, hs_spawn and hs_wait_http print the exact command / wait instead of running
#     it and nothing is created on disk. API keys are printed as '***' (dry run and command log alike).
#   - Bad configuration ends the script with exit code 2 and one "error: ..." line on stderr.

HS_PIDS=()
HS_NAMES=()
HS_WAITER=""  # the PID of a running readiness wait (hs_wait_http), stopped with the rest
HS_TICKER=""  # the PID of hs_wait_any's current ticker, stopped with the rest
# bash interrupts a `wait` for a trapped signal (Ctrl-C, a stop), except one that lands in the instant before the
# wait blocks: that one stays pending until a waited-for process exits, which for a server can be days. So every
# wait of these scripts also wakes every HS_WAKE_S seconds (hs_wait_any), and a stop is handled within that time.
HS_WAKE_S=${HS_WAKE_S:-1}
HS_DRY_RUN=${HS_DRY_RUN:-${DRY_RUN:-0}}
HS_STOP_GRACE_S=${HS_STOP_GRACE_S:-20}
HS_PYTHON=${PYTHON:-python}
# Logs, pid files and data dirs hold prompts, replies and config: readable by this user only.
umask 077

# A log line must never end the script: with the reader gone, a failed write is ignored.
hs_log() { printf '[hindsight %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2 2>/dev/null || true; }
hs_die() { printf 'error: %s\n' "$*" >&2; exit 2; }

# hs_wait_any PID...: wait until one of PIDs (children of this shell) exits; return its exit status. A short-lived
# ticker among the waited-for processes wakes the wait every HS_WAKE_S seconds (see HS_WAKE_S above); a still
# running ticker afterwards means one of PIDs ended, and `wait -n` returned its status.
hs_wait_any() {
  local rc pid
  while :; do
    sleep "$HS_WAKE_S" &
    HS_TICKER=$!
    rc=0
    wait -n "$@" "$HS_TICKER" || rc=$?
    if kill -0 "$HS_TICKER" 2>/dev/null; then
      kill "$HS_TICKER" 2>/dev/null || true
      wait "$HS_TICKER" 2>/dev/null || true
      HS_TICKER=""
      return "$rc"
    fi
    HS_TICKER=""
    # The ticker ended. A process of PIDs that ended while no `wait -n` was running can already be reaped by
    # bash and dropped from its job table (seen under load: `wait -n` then never reports it), so each wake-up
    # also looks: a PID that is gone is waited for by its pid, whose status bash keeps.
    for pid in "$@"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        rc=0
        wait "$pid" 2>/dev/null || rc=$?
        return "$rc"
      fi
    done
  done
}

# Parse the arguments every script accepts: --dry-run, -h/--help, and KEY=VALUE assignments
# (so that `run.sh MODE=opd` works like `MODE=opd run.sh`). Usage text comes from $HS_USAGE.
hs_parse_args() {
  local arg
  for arg in "$@"; do
    case "$arg" in
      --dry-run) HS_DRY_RUN=1 ;;
      -h|--help) printf '%s\n' "${HS_USAGE:-}"; exit 0 ;;
      [A-Z_]*=*) export "${arg?}" ;;
      *) hs_die "unknown argument '$arg' (try --help)" ;;
    esac
  done
}

# hs_add_flag ARRAY --flag "$VALUE": append the flag to the named command array only when VALUE is set.
# An unset knob leaves the program's own default in force: the scripts never restate a Python default.
hs_add_flag() {
  local -n _hs_cmd=$1
  [[ -z $3 ]] || _hs_cmd+=("$2" "$3")
}

hs_is_loopback() { [[ $1 == 127.* || $1 == localhost || $1 == ::1 ]]; }

# Services bound beyond loopback must not be open: refuse to start without the named keys.
hs_require_keys_if_public() {
  local host=$1 var; shift
  hs_is_loopback "$host" && return 0
  for var in "$@"; do
    [[ -n ${!var:-} ]] || hs_die "HOST=$host is not loopback: set $var (a secret API key) or bind HOST=127.0.0.1"
  done
}

# Address other processes on this node use to reach a server bound to $1.
hs_connect_host() { if [[ $1 == 0.0.0.0 || $1 == "::" ]]; then echo 127.0.0.1; else echo "$1"; fi; }

# Validate a comma-separated GPU id list against NUM_GPUS; print its size.
hs_gpu_count() {
  local var=$1 list=${2// /} id n=0 seen=","
  local -a _ids
  [[ -n $list ]] || hs_die "$var is empty: give GPU ids like 0,1"
  IFS=',' read -r -a _ids <<<"$list"
  for id in "${_ids[@]}"; do
    [[ $id =~ ^[0-9]+$ ]] || hs_die "$var='$list': '$id' is not a GPU id (ids, not counts: e.g. 0,1,2,3)"
    (( id < NUM_GPUS )) || hs_die "$var='$list': GPU $id does not exist on a node with NUM_GPUS=$NUM_GPUS"
    [[ $seen != *",$id,"* ]] || hs_die "$var='$list' lists GPU $id twice"
    seen+="$id,"; n=$((n + 1))
  done
  echo "$n"
}

# Fail when two named GPU lists share a device.
hs_check_disjoint() {
  local a=$1 b=$2 id
  local -a _a
  IFS=',' read -r -a _a <<<"${!a// /}"
  for id in "${_a[@]}"; do
    [[ ",${!b// /}," != *",$id,"* ]] || hs_die "GPU $id is in both $a=${!a} and $b=${!b}: the GPU sets must not overlap"
  done
}

# Number of engines for a GPU list with tp GPUs each; the list must split evenly.
hs_engine_count() {
  local var=$1 list=$2 tp=$3 n
  [[ $tp =~ ^[1-9][0-9]*$ ]] || hs_die "tensor-parallel size '$tp' for $var must be a positive integer"
  n=$(hs_gpu_count "$var" "$list") || exit 2
  (( n % tp == 0 )) || hs_die "$var='$list' has $n GPUs, not a multiple of the tp size $tp"
  echo $((n / tp))
}

# GPUs of engine i (0-based) when a list is cut into consecutive groups of tp.
hs_engine_gpus() {
  local list=${1// /} tp=$2 i=$3
  local -a _ids
  IFS=',' read -r -a _ids <<<"$list"
  local IFS=','; echo "${_ids[*]:$((i * tp)):$tp}"
}

# Shell-quote one word, leaving plain words (paths, URLs, id lists) unquoted for readability.
hs_quote() {
  if [[ $1 =~ ^[A-Za-z0-9_,./:@+=-]+$ ]]; then printf '%s' "$1"; else printf '%q' "$1"; fi
}

# Print a command with keys redacted: the value after any --*api-key flag and any *KEY=* env value.
hs_render() {
  local out="" redact=0 word
  for word in "$@"; do
    if (( redact )); then out+="'***' "; redact=0; continue; fi
    case "$word" in
      --*api-key|--*api-keys) redact=1; out+="$word " ;;
      [A-Z_]*KEY=*|[A-Z_]*STORE_URL=*) out+="${word%%=*}='***' " ;;  # a store URL may hold a password
      [A-Z_]*=*) out+="${word%%=*}=$(hs_quote "${word#*=}") " ;;
      *) out+="$(hs_quote "$word") " ;;
    esac
  done
  printf '%s' "${out% }"
}

hs_prepare_run_dir() {
  (( HS_DRY_RUN )) && return 0
  mkdir -p "$HS_RUN_DIR/logs" "$HS_RUN_DIR/pids"
}

# hs_spawn NAME [VAR=VALUE ...] -- COMMAND ARGS...
hs_spawn() {
  local name=$1; shift
  local -a envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  local log="$HS_RUN_DIR/logs/$name.log"
  if (( HS_DRY_RUN )); then
    printf '%s > %s 2>&1 &\n' "$(hs_render "${envs[@]}" "$@")" "$(printf '%q' "$log")"
    return 0
  fi
  printf '%s\n' "$(hs_render "${envs[@]}" "$@")" >>"$HS_RUN_DIR/commands.log"
  # setsid: own process group, so a stop reaches the processes this one forks and nothing else.
  setsid env "${envs[@]}" "$@" >>"$log" 2>&1 </dev/null &
  local pid=$!
  HS_PIDS+=("$pid"); HS_NAMES+=("$name")
  echo "$pid" >"$HS_RUN_DIR/pids/$name.pid"
  hs_log "started $name (pid $pid, log $log)"
}

# hs_wait_http NAME URL DEADLINE_S: poll until URL answers 200; fail fast if NAME's process exits.
hs_wait_http() {
  local name=$1 url=$2 deadline_s=$3 pid="" i
  if (( HS_DRY_RUN )); then
    printf '# wait until %s answers 200 (deadline %ss)\n' "$url" "$deadline_s"
    return 0
  fi
  for i in "${!HS_NAMES[@]}"; do [[ ${HS_NAMES[$i]} == "$name" ]] && pid=${HS_PIDS[$i]}; done
  # In the background and waited on with the `wait` builtin, which a trapped signal interrupts (bash runs
  # a trap only after a foreground child ends, and this one could poll until its deadline).
  "$HS_PYTHON" - "$url" "$deadline_s" "${pid:-0}" <<'PY' &
import os, sys, time, urllib.request, urllib.error
url, deadline_s, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
end = time.monotonic() + deadline_s
while time.monotonic() < end:
    if pid:
        # An exited child stays a zombie until the script waits for it: check the state, not existence.
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("Z", "X", "gone"):
            sys.exit(f"process {pid} exited before {url} was ready")
    try:
        if opener.open(url, timeout=5).status == 200:
            sys.exit(0)
    except (urllib.error.URLError, OSError):
        pass
    time.sleep(1)
sys.exit(1)
PY
  HS_WAITER=$!
  hs_wait_any "$HS_WAITER" || hs_die "$name not ready at $url within ${deadline_s}s (see $HS_RUN_DIR/logs/$name.log)"
  HS_WAITER=""
  hs_log "$name ready at $url"
}

# hs_signal SIG PID: signal the process group PID leads; else PID itself while it is still this shell's child: one
# that has not yet reached its setsid (on a loaded machine that can be well after the script went on) would
# otherwise be missed and then waited for forever. A PID that is not our child any more is never signalled.
hs_signal() {
  kill "-$1" -- "-$2" 2>/dev/null && return 0
  local stat ppid
  read -r stat 2>/dev/null <"/proc/$2/stat" || return 1
  read -r _ ppid _ <<<"${stat##*) }"  # after the command name (which may hold spaces): state, then parent PID
  [[ $ppid == "$$" ]] && kill "-$1" "$2" 2>/dev/null
}

hs_cleanup() {
  local rc=$? i pid alive deadline=$((SECONDS + HS_STOP_GRACE_S))
  trap - EXIT INT TERM
  trap '' PIPE  # the reader of our output may be gone (that may be why we stop): keep going regardless
  [[ -z ${HS_WAITER:-} ]] || kill -TERM "$HS_WAITER" 2>/dev/null || true
  [[ -z ${HS_TICKER:-} ]] || kill -TERM "$HS_TICKER" 2>/dev/null || true
  (( ${#HS_PIDS[@]} )) || exit "$rc"
  hs_log "stopping ${HS_NAMES[*]}"
  for (( i=${#HS_PIDS[@]}-1; i>=0; i-- )); do hs_signal TERM "${HS_PIDS[$i]}" || true; done
  # The grace is wall-clock seconds: on a loaded machine each poll below can take far longer than its sleep.
  while (( SECONDS < deadline )); do
    alive=0
    for pid in "${HS_PIDS[@]}"; do hs_signal 0 "$pid" && alive=1; done
    (( alive )) || break
    sleep 0.1
  done
  for pid in "${HS_PIDS[@]}"; do
    if hs_signal 0 "$pid"; then
      hs_log "process group $pid ignored SIGTERM for ${HS_STOP_GRACE_S}s: SIGKILL"
      hs_signal KILL "$pid" || true
    fi
  done
  for i in "${!HS_PIDS[@]}"; do
    wait "${HS_PIDS[$i]}" 2>/dev/null || true
    rm -f "$HS_RUN_DIR/pids/${HS_NAMES[$i]}.pid"
  done
  exit "$rc"
}

hs_install_trap() {
  (( HS_DRY_RUN )) && return 0
  trap hs_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

# Stay in the foreground until one started process exits (then the trap stops the rest).
hs_supervise() {
  (( HS_DRY_RUN )) && return 0
  local rc=0 i
  hs_log "all up; logs in $HS_RUN_DIR/logs; Ctrl-C stops everything this script started"
  hs_wait_any "${HS_PIDS[@]}" || rc=$?
  for i in "${!HS_PIDS[@]}"; do
    kill -0 "${HS_PIDS[$i]}" 2>/dev/null || hs_log "${HS_NAMES[$i]} (pid ${HS_PIDS[$i]}) exited with $rc"
  done
  return "$rc"
}

# Values shared by every script; each is overridable from the environment (see docs/LAUNCH.md).
hs_common_defaults() {
  : "${HOST:=127.0.0.1}"                 # bind address of every server; non-loopback requires API keys
  : "${NUM_GPUS:=8}"                     # GPUs on this node (ids 0..NUM_GPUS-1)
  : "${HINDSIGHT_RUN_DIR:=.hindsight/run-$(date +%Y%m%d-%H%M%S)}"
  HS_RUN_DIR=$HINDSIGHT_RUN_DIR
  : "${ENGINE_API_KEY:=}"                # bearer of the SGLang engines and routers (empty: none)
  : "${SGLANG_PYTHON:=$HS_PYTHON}"       # interpreter with sglang installed (often a separate env)
  : "${ROUTER_PYTHON:=$HS_PYTHON}"       # interpreter with sglang-router installed
  : "${ROUTER_POLICY:=cache_aware}"      # prefix-cache aware routing: the judge re-sends one prompt m times
  : "${ENGINE_READY_TIMEOUT_S:=1800}"    # model load + CUDA graph capture
  : "${ROUTER_READY_TIMEOUT_S:=300}"
  : "${SERVICE_READY_TIMEOUT_S:=300}"
  HS_CONNECT_HOST=$(hs_connect_host "$HOST")
}

# hs_start_router NAME PORT METRICS_PORT WORKER_URL...: sglang-router in front of ready engines.
hs_start_router() {
  local name=$1 port=$2 metrics_port=$3; shift 3
  local -a cmd=("$ROUTER_PYTHON" -m sglang_router.launch_router --host "$HOST" --port "$port"
    --worker-urls "$@" --policy "$ROUTER_POLICY"
    --prometheus-host 127.0.0.1 --prometheus-port "$metrics_port"
    --worker-startup-check-interval 5 --health-check-interval-secs 10 --log-level warn)
  [[ -z $ENGINE_API_KEY ]] || cmd+=(--api-key "$ENGINE_API_KEY")
  hs_spawn "$name" -- "${cmd[@]}"
  # /health answers 200 even without workers; /readiness only once a worker is healthy.
  hs_wait_http "$name" "http://$HS_CONNECT_HOST:$port/readiness" "$ROUTER_READY_TIMEOUT_S"
}

# hs_start_engines PREFIX MODEL GPUS TP BASE_PORT EXTRA_ARGS: one SGLang server per TP group, ready.
# Prints nothing; sets HS_ENGINE_URLS to the engines' URLs.
hs_start_engines() {
  local prefix=$1 model=$2 gpus=$3 tp=$4 base_port=$5 extra=$6 n i port
  local -a cmd extra_words
  n=$(hs_engine_count "${prefix^^}_GPUS" "$gpus" "$tp") || exit 2
  read -r -a extra_words <<<"$extra"
  HS_ENGINE_URLS=()
  for (( i=0; i<n; i++ )); do
    port=$((base_port + i))
    cmd=("$SGLANG_PYTHON" -m sglang.launch_server --model-path "$model" --tp-size "$tp"
      --host "$HOST" --port "$port" "${extra_words[@]}")
    [[ -z $ENGINE_API_KEY ]] || cmd+=(--api-key "$ENGINE_API_KEY")
    hs_spawn "$prefix-engine-$i" "CUDA_VISIBLE_DEVICES=$(hs_engine_gpus "$gpus" "$tp" "$i")" -- "${cmd[@]}"
    HS_ENGINE_URLS+=("http://$HS_CONNECT_HOST:$port")
  done
  # Engines load in parallel; wait for each after all are started.
  for (( i=0; i<n; i++ )); do
    hs_wait_http "$prefix-engine-$i" "${HS_ENGINE_URLS[$i]}/health" "$ENGINE_READY_TIMEOUT_S"
  done
}

#!/usr/bin/env bash
# Serve the model repository with a real tritonserver (prefill/decode disaggregated ensemble).
#
#   scripts/serve.sh [--model-repo DIR] [--model CKPT] [--http-port 8000] [--grpc-port 8001]
#                    [--metrics-port 8002] [--host 127.0.0.1] [--bootstrap-host 127.0.0.1]
#                    [--secret-file FILE] [--set [stage.]param=value ...] [--set-file FILE]
#                    [--draft DIR | --draft-layers K] [--spec-tokens N]
#                    [--prefill-gpus 0,1] [--decode-gpus 2,3]
#                    [--role all|prefill|decode] [--prefill-servers HOST:GRPC_PORT[,...]]
#                    [--openai-port 9000 | --no-openai] [--openai-host ADDR] [--api-key-file FILE]
#                    [--foreground] [--log FILE] [--stop] [--stop-timeout 30] [--no-supervise]
#
# tritonserver: the one on PATH (NGC image: /opt/tritonserver/bin), else the binary of the
# nvidia-pytriton wheel in .venv. Default: start in the background, wait until ready, print the
# URLs and the log path. --foreground: stay attached; Ctrl-C or SIGTERM stops it. --stop: stop
# the server started on --http-port: SIGTERM, at most --stop-timeout seconds for Triton to finish
# (in-flight requests get an error), then the whole process group (stage processes included).
# --host: address of Triton's HTTP/gRPC/metrics ports (use 0.0.0.0 to serve other hosts).
# --bootstrap-host: address the stages' KV control and data planes bind to (default loopback).
# Shared secret (HMAC on every control message): --secret-file (created, mode 600, if missing;
# give every server of a deployment the same file) or $PD_SHARED_SECRET; else a random one per
# start. A secret that is weak (under 16 characters, under 8 different ones, a repeated piece, or
# the placeholder deploy/kubernetes/secret.yaml ships) is refused: `openssl rand -hex 32` makes one.
# --model CKPT / --set (--set-file: one per line) / --draft* / --*-gpus write a tuned copy
# of the repository
# (scripts/make_repo.py). Speculative decoding: --draft DIR (a draft checkpoint sharing the
# target's vocabulary), --draft-layers K (self-draft), --spec-tokens N. --prefill-gpus /
# --decode-gpus LIST place a stage on GPUs (KIND_GPU, one instance per GPU; with
# --set STAGE.tensor_parallel_size=N, one instance per N consecutive GPUs, its ranks); without
# them a stage's device is `auto` (its GPU, else cuda:0 when there is one, else the CPU).
# --role: `all` (default) is the single server (every stage here); `prefill` serves only the
# prefill model (a prefill server: give it a --bootstrap-host decode servers can reach);
# `decode` serves the client-facing ensemble whose prefill step is the router model, forwarding
# each request over gRPC to the least loaded of --prefill-servers HOST:GRPC_PORT[:METRICS_PORT]
# (metrics port default GRPC_PORT+1) and re-dispatching when one fails. Every server of a
# deployment needs the same --secret-file (or $PD_SHARED_SECRET).
# Models load in explicit model-control mode; the repository, shared-memory, trace and logging
# APIs need the header `pd-admin-key: $(cat .run/admin-key-PORT)` (a random key per start).
# scripts/supervise.py runs beside the server and reloads a model whose Python stub died
# (Triton does not restart one); --no-supervise turns that off.
# Every server that serves the ensemble (roles all and decode) also gets the OpenAI-compatible
# API (python -m backends.openai: /v1/chat/completions, /v1/completions, /v1/models, /health) on
# --host:--openai-port (default 9000; its log: .run/openai-HTTP_PORT.log); --no-openai: none.
# --openai-host ADDR (or $PD_OPENAI_HOST): the front's address when it differs from --host.
# --api-key-file FILE (or $PD_API_KEY_FILE; $PD_API_KEY adds one key): the front's API keys, one
# a line; every /v1 route then needs 'Authorization: Bearer KEY' (/health stays open). A front
# on an address other than loopback needs a key: without one serve.sh refuses to start
# ($PD_INSECURE_NO_API_KEY=1 allows it, e.g. behind an authenticating proxy).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HTTP=8000 GRPC=8001 METRICS=8002 FOREGROUND=0 STOP=0 CKPT="" REPO="$ROOT/model_repository"
HOST=127.0.0.1 SECRET_FILE="" STOP_TIMEOUT="${PD_STOP_TIMEOUT:-30}" SUPERVISE=1
RUN_DIR="${PD_RUN_DIR:-$ROOT/.run}"
LOG="" TIMEOUT="${PD_SERVE_TIMEOUT:-300}"
SETS=() PLACE=() ROLE=all OPENAI_PORT=9000 OPENAI=1
OPENAI_HOST="${PD_OPENAI_HOST:-}" API_KEY_FILE="${PD_API_KEY_FILE:-}"
die() { echo "serve.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --http-port) HTTP="$2"; shift 2 ;;
    --grpc-port) GRPC="$2"; shift 2 ;;
    --metrics-port) METRICS="$2"; shift 2 ;;
    --host) HOST="$2"; shift 2 ;;
    --bootstrap-host) SETS+=(--set "bootstrap_host=$2"); shift 2 ;;
    --secret-file) SECRET_FILE="$2"; shift 2 ;;
    --role)
      case "${2:-}" in all|prefill|decode) ROLE="$2" ;; *) die "--role must be all, prefill or decode" ;; esac
      shift 2 ;;
    --prefill-servers) SETS+=(--set "prefill_servers=$2"); shift 2 ;;
    --set) SETS+=(--set "$2"); shift 2 ;;
    --set-file)  # one [stage.]param=value per line (# comments), e.g. a mounted ConfigMap
      [ -f "${2:-}" ] || die "--set-file ${2:-} is not a file"
      while IFS= read -r line || [ -n "$line" ]; do
        line="${line%%#*}"; line="$(echo "$line" | tr -d '[:space:]')"
        [ -n "$line" ] && SETS+=(--set "$line")
      done <"$2"
      shift 2 ;;
    --model) CKPT="$2"; shift 2 ;;
    --model-repo) REPO="$2"; shift 2 ;;
    --log) LOG="$2"; shift 2 ;;
    --draft)
      [ -d "${2:-}" ] || die "--draft ${2:-} is not a directory"
      SETS+=(--set spec_enabled=true --set "draft_model_dir=$(cd "$2" && pwd)"); shift 2 ;;
    --draft-layers) SETS+=(--set spec_enabled=true --set "draft_layers=$2"); shift 2 ;;
    --spec-tokens) SETS+=(--set spec_enabled=true --set "decode.spec_tokens=$2"); shift 2 ;;
    --prefill-gpus|--decode-gpus)
      [[ "${2:-}" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "$1 needs GPU indices like 0,1"
      PLACE+=("$1" "$2"); shift 2 ;;
    --openai-port) OPENAI_PORT="$2"; shift 2 ;;
    --no-openai) OPENAI=0; shift ;;
    --openai-host) OPENAI_HOST="$2"; shift 2 ;;
    --api-key-file) API_KEY_FILE="$2"; shift 2 ;;
    --foreground) FOREGROUND=1; shift ;;
    --stop) STOP=1; shift ;;
    --stop-timeout) STOP_TIMEOUT="$2"; shift 2 ;;
    --no-supervise) SUPERVISE=0; shift ;;
    -h|--help) sed -n '2,48p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[[ "$STOP_TIMEOUT" =~ ^[0-9]+$ ]] && [ "$STOP_TIMEOUT" -ge 2 ] || die "--stop-timeout needs seconds >= 2"
mkdir -p "$RUN_DIR"
PIDFILE="$RUN_DIR/tritonserver-$HTTP.pid" SUPFILE="$RUN_DIR/supervise-$HTTP.pid"
KEYFILE="$RUN_DIR/admin-key-$HTTP" OAIFILE="$RUN_DIR/openai-$HTTP.pid"
LOG="${LOG:-$RUN_DIR/tritonserver-$HTTP.log}"

# SIGTERM to tritonserver, at most STOP_TIMEOUT s for it to finish, then SIGKILL to whatever is
# left of its process group (it leads one: started with setsid), stage processes included.
stop_server() {
  local pid="$1" end=$((SECONDS + STOP_TIMEOUT))
  kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 0.25; done
  if pgrep -g "$pid" >/dev/null 2>&1; then
    kill -0 "$pid" 2>/dev/null && echo "[serve] still running after ${STOP_TIMEOUT}s: SIGKILL"
    kill -KILL -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do pgrep -g "$pid" >/dev/null 2>&1 || break; sleep 0.25; done
  fi
}

stop_supervisor() {
  [ -f "$SUPFILE" ] && kill -TERM "$(cat "$SUPFILE")" 2>/dev/null || true
  rm -f "$SUPFILE"
  [ -f "$OAIFILE" ] && kill -TERM "$(cat "$OAIFILE")" 2>/dev/null || true
  rm -f "$OAIFILE"
}

if [ "$STOP" = 1 ]; then
  [ -f "$PIDFILE" ] || { echo "no server started by serve.sh on port $HTTP"; exit 0; }
  PID="$(cat "$PIDFILE")"
  stop_supervisor
  stop_server "$PID"
  rm -f "$PIDFILE" "$KEYFILE"; echo "stopped tritonserver (pid $PID) and its stage processes"; exit 0
fi

PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
if command -v tritonserver >/dev/null && [ -d /opt/tritonserver/backends/python ]; then
  TRITONSERVER="$(command -v tritonserver)" BACKEND_DIR=/opt/tritonserver/backends
else
  eval "$("$PY" "$ROOT/scripts/triton_paths.py")"
  "$PY" "$ROOT/scripts/triton_paths.py" --install-stub >/dev/null
fi
# the secret first: make_repo checks that a non-loopback bootstrap_host has one
new_secret() { "$PY" -c 'import secrets; print(secrets.token_hex(32))'; }
# the deployment secrets' strength rule (backends/stages/keys.py; the stages check it too)
weak_secret() { printf %s "$PD_SHARED_SECRET" | PYTHONPATH="$ROOT" "$PY" -m backends.stages.keys "$1"; }
if [ -n "$SECRET_FILE" ]; then
  [ -s "$SECRET_FILE" ] || (umask 077; mkdir -p "$(dirname "$SECRET_FILE")"; new_secret >"$SECRET_FILE")
  PD_SHARED_SECRET="$(tr -d '[:space:]' <"$SECRET_FILE")"
  weak_secret "serve.sh: the shared secret in $SECRET_FILE" || exit 2
elif [ -n "${PD_SHARED_SECRET:-}" ]; then
  weak_secret "serve.sh: the shared secret in \$PD_SHARED_SECRET" || exit 2
else
  PD_SHARED_SECRET="$(new_secret)"  # this server's stages only: HMAC on by default
fi
export PD_SHARED_SECRET
# the OpenAI front's keys and address, checked before the server starts (it would refuse later)
OPENAI_HOST="${OPENAI_HOST:-$HOST}" OAI_ARGS=(--host "$OPENAI_HOST")
[ -n "$API_KEY_FILE" ] && OAI_ARGS+=(--api-key-file "$API_KEY_FILE")
if [ "$OPENAI" = 1 ] && [ "$ROLE" != prefill ]; then
  PYTHONPATH="$ROOT" "$PY" -m backends.openai "${OAI_ARGS[@]}" --check-config || exit 2
fi
if [ -n "$CKPT" ] || [ ${#SETS[@]} -gt 0 ] || [ ${#PLACE[@]} -gt 0 ] || [ "$ROLE" != all ]; then
  OUT="$RUN_DIR/model_repository-$HTTP"
  MR=("$ROOT/scripts/make_repo.py" --src "$REPO" --out "$OUT" --role "$ROLE")
  [ -n "$CKPT" ] && MR+=(--model "$CKPT")
  "$PY" "${MR[@]}" ${SETS[@]+"${SETS[@]}"} ${PLACE[@]+"${PLACE[@]}"} >/dev/null
  REPO="$OUT"
fi
# the models of this role that the repository has (a role-all server never loads the router)
MODELS=()
for d in "$REPO"/*/config.pbtxt; do
  [ -f "$d" ] || continue  # no match: the pattern itself
  m="$(basename "$(dirname "$d")")"
  [ "$ROLE" = all ] && [ "$m" = router ] && continue
  MODELS+=("$m")
done
[ ${#MODELS[@]} -gt 0 ] || die "no models in $REPO"
MODEL_LIST="$(IFS=,; echo "${MODELS[*]}")"

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel="${GLOG_minloglevel:-2}" TOKENIZERS_PARALLELISM=false MC_FORCE_TCP="${MC_FORCE_TCP:-1}"
# shellcheck source=scripts/bind_env.sh
source "$ROOT/scripts/bind_env.sh"
export PD_RETIRE_DIR="$RUN_DIR/retire"  # the supervisor asks replaced stage processes to exit
mkdir -p "$PD_RETIRE_DIR"
EXIT_TIMEOUT=$((STOP_TIMEOUT > 10 ? STOP_TIMEOUT - 5 : STOP_TIMEOUT / 2))
(umask 077; new_secret >"$KEYFILE")
RESTRICTED="model-repository,shared-memory,trace,logging:pd-admin-key=$(cat "$KEYFILE")"
LOADS=()
for m in "${MODELS[@]}"; do LOADS+=(--load-model "$m"); done
# --disable-auto-complete-config: every config.pbtxt is complete, and auto-completion makes the
# Python backend start one extra stub per model that imports model.py (torch and all) before the
# instances' own: 9 s of a 25 s start on 2 cores (measured)
ARGS=(--model-repository "$REPO" --backend-directory "$BACKEND_DIR"
      --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS"
      --http-address "$HOST" --grpc-address "$HOST" --metrics-address "$HOST"
      --allow-metrics true --log-verbose 0 --exit-on-error true --exit-timeout-secs "$EXIT_TIMEOUT"
      --model-control-mode explicit --disable-auto-complete-config
      --http-restricted-api "$RESTRICTED" --grpc-restricted-protocol "$RESTRICTED" "${LOADS[@]}")

# the OpenAI-compatible front (it exits when tritonserver does); its name for the model is the
# checkpoint directory's
start_openai() {
  [ "$OPENAI" = 1 ] && [ "$ROLE" != prefill ] || return 0
  local dir name ctx probe="$OPENAI_HOST"
  param() {
    sed -n "s/.*key: *\"$1\" *value: *{ *string_value: *\"\([^\"]*\)\".*/\1/p" \
      "$REPO/preprocess/config.pbtxt" | head -1
  }
  dir="$(param model_dir)" ctx="$(param max_context)"
  name="$(basename "${dir:-smollm2-135m-instruct}")"
  [ "$probe" = 0.0.0.0 ] && probe=127.0.0.1
  setsid "$PY" -m backends.openai "${OAI_ARGS[@]}" --port "$OPENAI_PORT" --grpc-url "$HOST:$GRPC" \
    --model-name "$name" --model-name ensemble --server-pid "$1" ${ctx:+--max-context "$ctx"} \
    >>"$RUN_DIR/openai-$HTTP.log" 2>&1 </dev/null &
  echo $! >"$OAIFILE"
  for _ in $(seq 1 60); do  # any answer (/health is open): it listens
    curl -s -o /dev/null "http://$probe:$OPENAI_PORT/health" 2>/dev/null && return 0
    kill -0 "$(cat "$OAIFILE")" 2>/dev/null || break
    sleep 0.25
  done
  kill "$(cat "$OAIFILE")" 2>/dev/null || true
  rm -f "$OAIFILE"
  echo "[serve] the OpenAI front did not start on $OPENAI_HOST:$OPENAI_PORT (port in use? pick another with" \
    "--openai-port, or --no-openai); last lines of $RUN_DIR/openai-$HTTP.log:" >&2
  tail -n 5 "$RUN_DIR/openai-$HTTP.log" >&2
  return 1
}

# the watcher that reloads a model whose stub died; it exits when tritonserver does
start_supervisor() {
  start_openai "$1" || return 1
  [ "$SUPERVISE" = 1 ] || return 0
  setsid "$PY" "$ROOT/scripts/supervise.py" --url "http://$HOST:$HTTP" --pid "$1" \
    --key-file "$KEYFILE" --retire-dir "$PD_RETIRE_DIR" --models "$MODEL_LIST" >>"$2" 2>&1 </dev/null &
  echo $! >"$SUPFILE"
}

if [ "$FOREGROUND" = 1 ]; then
  echo "[serve] $TRITONSERVER (repository $REPO); Ctrl-C stops it"
  setsid "$TRITONSERVER" "${ARGS[@]}" &
  PID=$!
  trap 'stop_supervisor; stop_server $PID; exit 0' INT TERM
  for _ in $(seq 1 "$TIMEOUT"); do
    curl -sf "http://$HOST:$HTTP/v2/health/ready" >/dev/null 2>&1 && break
    kill -0 "$PID" 2>/dev/null || break
    sleep 1
  done
  start_supervisor "$PID" /dev/stdout || { stop_server "$PID"; exit 1; }
  wait $PID || true
  stop_supervisor; stop_server "$PID"
  exit 0
fi

if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "a server started by serve.sh already runs on port $HTTP (pid $(cat "$PIDFILE")); --stop it first" >&2
  exit 1
fi
: >"$LOG"  # both tritonserver and the supervisor append to it
setsid "$TRITONSERVER" "${ARGS[@]}" >>"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$PIDFILE"
printf '[serve] starting tritonserver (pid %s, log %s) ' "$PID" "$LOG"
for i in $(seq 1 "$TIMEOUT"); do
  if ! kill -0 "$PID" 2>/dev/null; then
    echo; echo "[serve] tritonserver exited; last log lines:" >&2; tail -n 30 "$LOG" >&2
    stop_server "$PID"; rm -f "$PIDFILE"; exit 1
  fi
  if curl -sf "http://$HOST:$HTTP/v2/health/ready" >/dev/null 2>&1; then
    echo " ready after ${i}s (role $ROLE: $MODEL_LIST)"
    start_supervisor "$PID" "$LOG" || { stop_server "$PID"; rm -f "$PIDFILE"; exit 1; }
    echo "[serve] HTTP    http://$HOST:$HTTP  (POST /v2/models/ensemble/generate[_stream])"
    echo "[serve] gRPC    $HOST:$GRPC"
    [ -f "$OAIFILE" ] && echo "[serve] OpenAI  http://$OPENAI_HOST:$OPENAI_PORT/v1  (chat/completions, completions, models)"
    echo "[serve] metrics http://$HOST:$METRICS/metrics"
    echo "[serve] log     $LOG   stop: scripts/serve.sh --stop --http-port $HTTP"
    echo "[serve] admin   header pd-admin-key: \$(cat $KEYFILE)  (model load/unload, shm, trace, logging)"
    exit 0
  fi
  [ $((i % 5)) = 0 ] && printf '.'
  sleep 1
done
echo; echo "[serve] not ready after ${TIMEOUT}s; see $LOG" >&2
stop_server "$PID"; rm -f "$PIDFILE"
exit 1

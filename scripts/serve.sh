#!/usr/bin/env bash
# Serve the model repository with a real tritonserver (prefill/decode disaggregated ensemble).
#
#   scripts/serve.sh [--model-repo DIR] [--model CKPT] [--http-port 8000] [--grpc-port 8001]
#                    [--metrics-port 8002] [--foreground] [--log FILE] [--stop]
#                    [--draft DIR | --draft-layers K] [--spec-tokens N]
#                    [--prefill-gpus 0,1] [--decode-gpus 2,3]
#
# tritonserver: the one on PATH (NGC image: /opt/tritonserver/bin), else the binary of the
# nvidia-pytriton wheel in .venv (scripts/triton_paths.py). Default: start in the background,
# wait until ready, print the URLs and the log path. --foreground: run attached; Ctrl-C or
# SIGTERM stops the server cleanly. --stop: stop a background server started by this script.
# --model CKPT serves another checkpoint (a copy of the repository is made with make_repo.py).
# Speculative decoding (any of these turns it on, in prefill and decode alike): --draft DIR (a
# draft checkpoint sharing the target's vocabulary), --draft-layers K (self-draft: the target's
# first K layers; the default when no --draft), --spec-tokens N (draft tokens per step).
# --prefill-gpus / --decode-gpus LIST place a stage on GPUs (KIND_GPU, one instance per GPU);
# without them each stage's device is `auto` (its GPU, else cuda:0 when there is one, else CPU).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HTTP=8000 GRPC=8001 METRICS=8002 FOREGROUND=0 STOP=0 CKPT="" REPO="$ROOT/model_repository"
RUN_DIR="${PD_RUN_DIR:-$ROOT/.run}"
LOG="" TIMEOUT="${PD_SERVE_TIMEOUT:-300}"
SETS=() PLACE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --http-port) HTTP="$2"; shift 2 ;;
    --grpc-port) GRPC="$2"; shift 2 ;;
    --metrics-port) METRICS="$2"; shift 2 ;;
    --model) CKPT="$2"; shift 2 ;;
    --model-repo) REPO="$2"; shift 2 ;;
    --log) LOG="$2"; shift 2 ;;
    --draft)
      [ -d "${2:-}" ] || { echo "serve.sh: --draft ${2:-} is not a directory" >&2; exit 2; }
      SETS+=(--set spec_enabled=true --set "draft_model_dir=$(cd "$2" && pwd)"); shift 2 ;;
    --draft-layers) SETS+=(--set spec_enabled=true --set "draft_layers=$2"); shift 2 ;;
    --spec-tokens) SETS+=(--set spec_enabled=true --set "decode.spec_tokens=$2"); shift 2 ;;
    --prefill-gpus|--decode-gpus)
      [[ "${2:-}" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "serve.sh: $1 needs GPU indices like 0,1" >&2; exit 2; }
      PLACE+=("$1" "$2"); shift 2 ;;
    --foreground) FOREGROUND=1; shift ;;
    --stop) STOP=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "serve.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$RUN_DIR"
PIDFILE="$RUN_DIR/tritonserver-$HTTP.pid"
LOG="${LOG:-$RUN_DIR/tritonserver-$HTTP.log}"

if [ "$STOP" = 1 ]; then
  [ -f "$PIDFILE" ] || { echo "no server started by serve.sh on port $HTTP"; exit 0; }
  PID="$(cat "$PIDFILE")"
  if kill -0 "$PID" 2>/dev/null; then
    kill -TERM "$PID"
    for _ in $(seq 1 60); do kill -0 "$PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$PID" 2>/dev/null && { echo "still running; sending SIGKILL"; kill -KILL "$PID"; }
  fi
  rm -f "$PIDFILE"; echo "stopped tritonserver (pid $PID)"; exit 0
fi

PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
if command -v tritonserver >/dev/null && [ -d /opt/tritonserver/backends/python ]; then
  TRITONSERVER="$(command -v tritonserver)" BACKEND_DIR=/opt/tritonserver/backends
else
  eval "$("$PY" "$ROOT/scripts/triton_paths.py")"
  "$PY" "$ROOT/scripts/triton_paths.py" --install-stub >/dev/null
fi
if [ -n "$CKPT" ] || [ ${#SETS[@]} -gt 0 ] || [ ${#PLACE[@]} -gt 0 ]; then
  OUT="$RUN_DIR/model_repository-$HTTP"
  MR=("$ROOT/scripts/make_repo.py" --src "$REPO" --out "$OUT")
  [ -n "$CKPT" ] && MR+=(--model "$CKPT")
  "$PY" "${MR[@]}" ${SETS[@]+"${SETS[@]}"} ${PLACE[@]+"${PLACE[@]}"} >/dev/null
  REPO="$OUT"
fi
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel="${GLOG_minloglevel:-2}" TOKENIZERS_PARALLELISM=false MC_FORCE_TCP="${MC_FORCE_TCP:-1}"
ARGS=(--model-repository "$REPO" --backend-directory "$BACKEND_DIR"
      --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS"
      --allow-metrics true --log-verbose 0 --exit-on-error true)

if [ "$FOREGROUND" = 1 ]; then
  echo "[serve] $TRITONSERVER (repository $REPO); Ctrl-C stops it"
  "$TRITONSERVER" "${ARGS[@]}" &
  PID=$!
  trap 'kill -TERM $PID 2>/dev/null; wait $PID; exit 0' INT TERM
  wait $PID
  exit $?
fi

if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "a server started by serve.sh already runs on port $HTTP (pid $(cat "$PIDFILE")); --stop it first" >&2
  exit 1
fi
nohup "$TRITONSERVER" "${ARGS[@]}" >"$LOG" 2>&1 &
PID=$!
echo "$PID" >"$PIDFILE"
printf '[serve] starting tritonserver (pid %s, log %s) ' "$PID" "$LOG"
for i in $(seq 1 "$TIMEOUT"); do
  if ! kill -0 "$PID" 2>/dev/null; then
    echo; echo "[serve] tritonserver exited; last log lines:" >&2; tail -n 30 "$LOG" >&2
    rm -f "$PIDFILE"; exit 1
  fi
  if curl -sf "http://127.0.0.1:$HTTP/v2/health/ready" >/dev/null 2>&1; then
    echo " ready after ${i}s"
    echo "[serve] HTTP    http://127.0.0.1:$HTTP  (POST /v2/models/ensemble/generate[_stream])"
    echo "[serve] gRPC    127.0.0.1:$GRPC"
    echo "[serve] metrics http://127.0.0.1:$METRICS/metrics"
    echo "[serve] log     $LOG   stop: scripts/serve.sh --stop --http-port $HTTP"
    exit 0
  fi
  [ $((i % 5)) = 0 ] && printf '.'
  sleep 1
done
echo; echo "[serve] not ready after ${TIMEOUT}s; see $LOG" >&2
exit 1

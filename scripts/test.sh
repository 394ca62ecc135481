#!/usr/bin/env bash
# The project's test command: lint, then every test tier (unit, integration with real Mooncake
# between processes, end-to-end with a real tritonserver). Extra arguments go to pytest,
# e.g. `scripts/test.sh tests/unit -k layout`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="$ROOT/.venv/bin/python"
[ -x "$VPY" ] || { echo "no .venv: run scripts/setup.sh first" >&2; exit 1; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# One torch thread per process: the tests run several processes at once (pytest, tritonserver's
# prefill and decode stubs, Mooncake peers); with every process spinning one OpenMP thread per
# core, multi-token forwards on a 2-core host slowed ~10x (measured).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" GLOG_minloglevel="${GLOG_minloglevel:-2}"
echo "[test] ruff"
"$VPY" -m ruff check backends kvtransfer scripts tests model_repository
# Two pytest workers, a test file each at a time (its module fixtures start once): the suite
# spends most of its time waiting on servers, startups and timeouts, not computing (one worker:
# ~14 CPU-minutes in ~27 wall-minutes on 2 cores). PD_TEST_WORKERS=0 runs in this process.
echo "[test] pytest"
exec "$VPY" -m pytest -ra --durations=15 -n "${PD_TEST_WORKERS:-2}" --dist loadfile "$@"

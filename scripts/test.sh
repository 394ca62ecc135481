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
"$VPY" -m ruff check backends kvtransfer scripts tests model_repository benchmarks
echo "[test] pytest"
if [ $# -gt 0 ] || [ "${PD_TEST_PARALLEL:-0}" != 1 ]; then
  exec "$VPY" -m pytest -ra --durations=15 "$@"
fi
# PD_TEST_PARALLEL=1: two pytest processes at once, the unit tests beside the server tiers
# (integration, e2e, multihost), which run one test at a time and mostly wait on startups and
# timeouts: ~5 minutes less, but not the default. In three fresh-clone runs it made a different
# timing-bound server test fail each time (the load of the unit tests beside them). Only one
# server test runs at a time: two e2e files at once ran the 24 GiB out.
UNIT_LOG="$(mktemp)"
trap 'rm -f "$UNIT_LOG"' EXIT
"$VPY" -m pytest -ra --durations=10 -p no:cacheprovider tests/unit >"$UNIT_LOG" 2>&1 &
UNIT=$!
rc=0
"$VPY" -m pytest -ra --durations=15 tests/integration tests/e2e tests/multihost || rc=$?
urc=0
wait "$UNIT" || urc=$?
echo "[test] tests/unit (ran beside the tiers above):"
cat "$UNIT_LOG"
exit $((rc != 0 ? rc : urc))

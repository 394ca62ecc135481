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
echo "[test] ruff"
"$VPY" -m ruff check backends kvtransfer scripts tests model_repository
echo "[test] pytest"
exec "$VPY" -m pytest -ra --durations=15 "$@"

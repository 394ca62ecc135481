#!/usr/bin/env bash
# The ensemble end to end on a lent GPU machine (issue 48, item 3): tritonserver from the
# nvidia-pytriton wheel's files, prefill and decode on the GPU, SmolLM2, greedy == transformers
# through gRPC and through the OpenAI front. NOT YET RUN ON A GPU: written and packed on the CPU
# host; the first GPU session that runs it should fix what it finds and say so here.
#
# On the CPU host, once: .venv/bin/python scripts/gpu_carry.py pack base mooncake serve pytriton smollm2
# Then three device-tool calls back to back (a warm machine keeps /tmp for about 30 s between
# calls; each call carries the working tree plus the groups named, under 64 MiB):
#   1. carry .gpu_carry/base .gpu_carry/mooncake .gpu_carry/serve .gpu_carry/pytriton
#        python3 scripts/gpu_carry.py install
#   2. carry .gpu_carry/smollm2a
#        python3 scripts/gpu_carry.py install
#   3. carry .gpu_carry/smollm2b
#        bash scripts/gpu_ensemble.sh
# This script is call 3: it installs this call's half (joining SmolLM2's GGUF), converts the model
# under /tmp and links models/ to it, then runs the e2e tests that start a real tritonserver
# (tests/e2e/test_e2e_gpu.py: --prefill-gpus 0 --decode-gpus 0, greedy == transformers over gRPC,
# streamed and not; tests/e2e/test_e2e_openai.py: the OpenAI front on the same kind of server,
# whose stages take cuda:0 by `device auto`). Logs and the report go to $OUT (else bench_out/gpu).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PD_PYTHON:-python3}"
DEST="${OUT:-$ROOT/bench_out/gpu}"
mkdir -p "$DEST"
"$PY" scripts/gpu_carry.py install | tee "$DEST/carry_report.txt"
export PYTHONPATH=/tmp/pd_site
mkdir -p /tmp/pd_models
[ -e models ] || ln -s /tmp/pd_models models
"$PY" scripts/convert_smollm2.py --out models/smollm2-135m-instruct 2>&1 | tail -n 3
export PD_TEST_DEVICE=cuda PD_RUNTIME_ATTENTION=triton MC_FORCE_TCP=1 GLOG_minloglevel=2
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
rc=0
"$PY" -m pytest -q -p no:cacheprovider -x tests/e2e/test_e2e_gpu.py \
  >"$DEST/e2e_gpu.log" 2>&1 || rc=$?
tail -n 5 "$DEST/e2e_gpu.log"
"$PY" -m pytest -q -p no:cacheprovider -x tests/e2e/test_e2e_openai.py \
  >"$DEST/e2e_openai.log" 2>&1 || rc=$?
tail -n 5 "$DEST/e2e_openai.log"
# the server's own log names the devices the stages ran on
grep -h "running on cuda" /tmp/pytest-of-*/pytest-*/*/*.log 2>/dev/null | sort | uniq -c | head || true
exit "$rc"

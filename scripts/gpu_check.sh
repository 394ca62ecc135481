#!/usr/bin/env bash
# The GPU check: run on a host with CUDA GPUs after scripts/setup.sh (which installs the CUDA
# builds of torch and Mooncake there). CI has no GPU; this is the script that covers the CUDA path.
#
#   scripts/gpu_check.sh [--quick] [--out DIR] [--only NAME,NAME...]
#
# --only runs just the named checks (the names in the summary: oracle, kernels, half, graphs,
# transfers, bench_runtime, ...), e.g. to re-run what failed.
# 1. the runtime oracle tests on CUDA (greedy == transformers, grouped prefill, batching, spec),
#    with the Triton attention kernel (the CUDA default) and again with gather + SDPA;
#    the Triton kernel against a float64 reference on the GPU (GQA, window, MLA, fp8 KV, splits);
#    float16 models (tiny + SmolLM2) and SmolLM2 bfloat16 greedy == transformers in that dtype;
#    decode from CUDA graphs (the CUDA default; PD_RUNTIME_CUDA_GRAPHS=0: eager) == eager ==
#    transformers;
# 2. byte-exact grouped KV transfers between OS processes from CUDA pools (GQA and MLA);
# 3. end to end through tritonserver with prefill and decode placed on GPUs (two GPUs when there
#    are two: --prefill-gpus 0 --decode-gpus 1; else both on GPU 0), greedy == transformers;
# 4. benchmarks on CUDA (python -m benchmarks.NAME; the checks are named bench_NAME): TTFT
#    colocated / serial / pipelined (ttft --quick), KV transfer vs raw Mooncake (transfer), decode
#    tok/s vs transformers (runtime), the Triton prefill attention vs SDPA (triton_attn); last,
#    8B shapes against the copy bandwidth and matmul peak beside transformers (gpu_roofline,
#    about 8 minutes, its JSON in DIR/gpu_roofline.json; the product's default attention, auto).
# Steps 2-3 and the transfer/TTFT benchmarks need Mooncake and tritonserver: without them they are
# listed as SKIPPED with the reason. PD_PYTHON: a Python with CUDA torch other than .venv's.
# Writes logs and JSON to DIR (default bench_out/gpu) and prints a summary table at the end.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="${PD_PYTHON:-$ROOT/.venv/bin/python}"  # PD_PYTHON: a Python with CUDA torch, if not .venv
OUT="$ROOT/bench_out/gpu" QUICK=0 ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --only) ONLY=",$2,"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$(command -v "$VPY")" ] || { echo "no .venv: run scripts/setup.sh first" >&2; exit 1; }
"$VPY" - <<'EOF' || { echo "gpu_check.sh: needs torch with CUDA and a GPU (see scripts/setup.sh)" >&2; exit 1; }
import sys, torch
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
mkdir -p "$OUT"
# PD_RUNTIME_ATTENTION=triton: a Triton kernel that fails raises instead of passing on SDPA
export PD_RUNTIME_ATTENTION="${PD_RUNTIME_ATTENTION:-triton}"
export PD_TEST_DEVICE=cuda PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false GLOG_minloglevel=2
export MC_FORCE_TCP="${MC_FORCE_TCP:-1}"
NGPU="$("$VPY" -c 'import torch; print(torch.cuda.device_count())')"
STATUS=()
step() { printf '\n[gpu_check] %s\n' "$*"; }
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember pass/fail, go on
  local name="$1"; shift
  [ -z "$ONLY" ] || [[ "$ONLY" == *",$name,"* ]] || return 0
  if "$@" >"$OUT/$name.log" 2>&1; then STATUS+=("$name: ok"); else STATUS+=("$name: FAILED (see $OUT/$name.log)"); fi
  tail -n 3 "$OUT/$name.log"
}
# what the later steps need beyond torch + Triton; a host without it skips them, said so
why_missing() {  # why_missing CMD...: nothing if CMD succeeds, else its last line of errors
  local err; err="$("$@" 2>&1 >/dev/null)" && return 0; tail -n 1 <<<"$err"
}
MISSING_MOONCAKE="$(why_missing "$VPY" -c 'from kvtransfer.link.engine import _load_transfer_engine as f; f()')"
MISSING_TRITON="$(why_missing "$VPY" scripts/triton_paths.py)"
skip() { [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]] || return 0; STATUS+=("$1: SKIPPED ($2)"); echo "skipped: $2"; }

step "GPUs: $NGPU ($(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs))"
step "1/4 runtime oracle tests on CUDA"
ORACLE=(tests/unit/test_runtime_smollm2.py tests/unit/test_runtime_models.py
  tests/unit/test_runtime_batching.py tests/unit/test_runtime_prefill.py
  tests/unit/test_spec_greedy.py tests/unit/test_spec_prefilled.py tests/unit/test_spec_eagle.py
  tests/unit/test_spec_sampling.py)
run oracle "$VPY" -m pytest -q -p no:cacheprovider "${ORACLE[@]}"
run oracle_sdpa env PD_RUNTIME_ATTENTION=sdpa "$VPY" -m pytest -q -p no:cacheprovider "${ORACLE[@]}"
run kernels "$VPY" -m pytest -q -p no:cacheprovider tests/unit/test_triton_attn_cuda.py \
  tests/unit/test_triton_attn_compile.py
run half "$VPY" -m pytest -q -p no:cacheprovider tests/unit/test_runtime_float16.py \
  tests/unit/test_runtime_fp8.py
run graphs "$VPY" -m pytest -q -p no:cacheprovider tests/unit/test_cuda_graphs.py
step "2/4 byte-exact grouped transfers from CUDA pools (GQA, MLA, MLA + GQA draft)"
if [ -n "$MISSING_MOONCAKE" ]; then skip transfers "$MISSING_MOONCAKE"; else
  run transfers "$VPY" -m pytest -q -p no:cacheprovider tests/integration/test_transfer_bytes.py \
    tests/integration/test_transfer_overlap.py
fi
step "3/4 end to end through tritonserver, stages on GPUs"
if [ -n "$MISSING_MOONCAKE$MISSING_TRITON" ]; then skip e2e "$MISSING_MOONCAKE$MISSING_TRITON"; else
  run e2e "$VPY" -m pytest -q -p no:cacheprovider tests/e2e/test_e2e_gpu.py
fi
step "4/4 benchmarks on CUDA"
REQ=5; [ "$QUICK" = 1 ] && REQ=2
if [ -n "$MISSING_MOONCAKE" ]; then skip bench_transfer "$MISSING_MOONCAKE"; else
  run bench_transfer "$VPY" -m benchmarks.transfer --device cuda --requests "$REQ" --json
fi
if [ -n "$MISSING_MOONCAKE$MISSING_TRITON" ]; then
  skip bench_ttft "$MISSING_MOONCAKE$MISSING_TRITON"
else
  run bench_ttft "$VPY" -m benchmarks.ttft --quick --device cuda --out "$OUT/ttft" --json
fi
run bench_runtime "$VPY" -m benchmarks.runtime --device cuda --runs 3 --json
run bench_runtime_sdpa env PD_RUNTIME_ATTENTION=sdpa "$VPY" -m benchmarks.runtime \
  --device cuda --runs 3 --json
run bench_runtime_fp16 "$VPY" -m benchmarks.runtime --device cuda --runs 3 \
  --dtype float16 --json
run bench_runtime_eager env PD_RUNTIME_CUDA_GRAPHS=0 "$VPY" -m benchmarks.runtime \
  --device cuda --runs 3 --json
run bench_triton_attn "$VPY" -m benchmarks.triton_attn --json
ROOF=(--json --out "$OUT/gpu_roofline.json"); [ "$QUICK" = 1 ] && ROOF+=(--quick)
run bench_gpu_roofline env PD_RUNTIME_ATTENTION=auto "$VPY" -m benchmarks.gpu_roofline "${ROOF[@]}"

step "summary"
printf '%s\n' "${STATUS[@]}"
"$VPY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]

def last_json(name):
    try:
        lines = [ln for ln in open(os.path.join(out, name + ".log")) if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except OSError:
        return None

t = last_json("bench_transfer")
if t:
    print(f"KV transfer (CUDA pools): kvtransfer {t['kvtransfer_gbps']:.2f} GB/s,"
          f" raw Mooncake {t['raw_gbps']:.2f} GB/s, ratio {t['ratio']:.2f}"
          + (f", link {t['link_gbps']:.2f} GB/s, link_ratio {t['link_ratio']:.2f}" if "link_gbps" in t else ""))
s = last_json("bench_ttft")
if s:
    keys = [k for k in ("exposed_fraction_pipelined", "groups", "first_token_over_colocated",
                        "short_prompt_pipelined_over_serial") if k in s]
    print("TTFT:", ", ".join(f"{k} {s[k]}" for k in keys), "| ttft_ms", s.get("ttft_ms"))
g = last_json("bench_gpu_roofline")
for name, sh in (g or {}).get("shapes", {}).items():
    keys = ("decode_b1_roofline_fraction", "prefill_8x2048_peak_fraction",
            "decode_b1_over_transformers", "decode_b32_over_transformers",
            "fp8_kv_over_bfloat16", "kvtransfer_over_d2h")
    print(f"gpu_roofline {name} on {sh['device']}: " + ", ".join(f"{k} {sh.get(k)}" for k in keys))
for log, what in (("bench_runtime", "triton attention"), ("bench_runtime_sdpa", "gather + SDPA"),
                  ("bench_runtime_fp16", "float16, triton attention"),
                  ("bench_runtime_eager", "CUDA graphs off")):
    r = last_json(log)
    if r:
        for impl, res in r["results"].items():
            print(f"runtime {impl} ({what}): " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
EOF
for s in "${STATUS[@]}"; do case "$s" in *FAILED*) exit 1 ;; esac; done

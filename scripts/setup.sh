#!/usr/bin/env bash
# One-command, idempotent setup on Debian 12 / Python 3.11.
#   - Debian packages: libibverbs1 (Mooncake), iproute2 (link emulation in benchmarks)
#   - .venv with this project and its dependencies (CPU torch on CPU hosts)
#   - tritonserver + Python backend from the nvidia-pytriton wheel when none is on PATH
#   - the default model converted to models/smollm2-135m-instruct/
# Re-running it only does what is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
step() { printf '\n[setup] %s\n' "$*"; }

step "Debian packages"
need_apt=()
for pkg in libibverbs1 iproute2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
else
  echo "already installed"
fi

step "virtual environment $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip

# PD_TARGET=cpu|cuda overrides the detection (a Docker build sees no GPU).
TARGET="${PD_TARGET:-auto}"
if [ "$TARGET" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=cuda; else TARGET=cpu; fi
fi
if [ "$TARGET" = cuda ]; then
  HAS_CUDA=1
  TORCH_SPEC="torch"
  # the CUDA build of Mooncake links libcudart.so.12; the wheel below provides it whatever CUDA
  # major torch uses (kvtransfer/link/engine.py loads it from there when the system has none)
  MOONCAKE="mooncake-transfer-engine==0.3.13.post1 nvidia-cuda-runtime-cu12"
else
  HAS_CUDA=0
  TORCH_SPEC="torch==2.13.0"          # the CPU build on disk; unpinned torch pulls CUDA wheels
  MOONCAKE="mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi
step "python packages (cuda=$HAS_CUDA)"
"$VPY" -m pip install -q "$TORCH_SPEC"
"$VPY" -m pip install -q $MOONCAKE
if ! command -v tritonserver >/dev/null 2>&1; then
  "$VPY" -m pip install -q "nvidia-pytriton==0.7.0"
fi
"$VPY" -m pip install -q -e ".[dev]"

step "tritonserver"
"$VPY" "$ROOT/scripts/triton_paths.py" --install-stub

step "KV data-plane bind shim"  # see scripts/bind_shim.c
command -v cc >/dev/null 2>&1 || { SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo";
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc libc6-dev; }
SHIM="$VENV/lib/pd_bind_shim.so"
if [ ! -f "$SHIM" ] || [ "$ROOT/scripts/bind_shim.c" -nt "$SHIM" ]; then
  cc -shared -fPIC -O2 -Wall -o "$SHIM" "$ROOT/scripts/bind_shim.c" -ldl
fi
echo "$SHIM"

step "runtime CPU kernels"  # see backends/runtime/cpu_kernels.py
command -v g++ >/dev/null 2>&1 || { SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo";
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++; }
"$VPY" -c "from backends.runtime import cpu_kernels; print(cpu_kernels.build())"

step "default model"
"$VPY" "$ROOT/scripts/convert_smollm2.py" --out "$ROOT/models/smollm2-135m-instruct"

step "done"
echo "activate with: source .venv/bin/activate"
echo "serve with:    scripts/serve.sh"
echo "test with:     scripts/test.sh"

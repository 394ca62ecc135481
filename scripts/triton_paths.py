"""Locate tritonserver and its Python backend; place the pytriton stub where it works.

Prints shell-friendly KEY=VALUE lines (TRITONSERVER, BACKEND_DIR) so serve.sh and the tests agree
on one binary. With --install-stub, copies the stub for the running Python into the wheel's
python backend directory (its RPATH only resolves from there, see shared/FACTS.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path


def find() -> tuple[str, str]:
    """Return (tritonserver binary, backend directory) or raise FileNotFoundError."""
    onpath = shutil.which("tritonserver")
    if onpath and Path("/opt/tritonserver/backends/python").is_dir():
        return onpath, "/opt/tritonserver/backends"
    # found, not imported: importing pytriton loads its client (aiohttp, tritonclient), 0.4 s
    # of each serve.sh start
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "no tritonserver on PATH and nvidia-pytriton is not installed: run scripts/setup.sh"
        )
    base = Path(spec.origin).parent / "tritonserver"
    binary = base / "bin" / "tritonserver"
    if not binary.exists():
        raise FileNotFoundError(f"{binary} missing: reinstall nvidia-pytriton")
    return str(binary), str(base / "backends")


def install_stub() -> None:
    binary, backends = find()
    py_backend = Path(backends) / "python"
    target = py_backend / "triton_python_backend_stub"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stubs = Path(binary).parent.parent / "python_backend_stubs" / ver
    src = stubs / "triton_python_backend_stub"
    if not src.exists():
        if target.exists():
            print(f"stub present: {target}")
            return
        raise FileNotFoundError(f"no python backend stub for Python {ver} under {stubs.parent}")
    if not target.exists() or target.stat().st_size != src.stat().st_size:
        shutil.copy2(src, target)
        os.chmod(target, 0o755)
    print(f"tritonserver: {binary}\npython backend stub: {target}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--install-stub", action="store_true")
    args = ap.parse_args()
    if args.install_stub:
        install_stub()
        return
    binary, backends = find()
    print(f"TRITONSERVER={binary}\nBACKEND_DIR={backends}")


if __name__ == "__main__":
    main()

"""The runtime's own C++ CPU kernels: built once per machine with the system compiler, loaded as
torch ops (``torch.ops.pd_runtime``).

* ``csrc/cpu_ops.cpp``: ``paged_decode``, decode attention that reads each sequence's K and V
  rows straight from the pool slots (no gathered copy), all the query heads of a KV head per row
  read; each query's keys a range of its slots (a sliding window's), optional sink logits;
* ``csrc/cpu_fused.cpp``: ``rms_norm``, ``add_rms_norm`` (residual add + norm), ``silu_mul``
  (the gated MLP's activation) and ``rope_write_kv`` (rotary embedding of q and k + the KV
  write): one pass each where torch runs several small ops.
* ``csrc/cpu_prefill.cpp``: ``prefill_attention``, causal attention of prompts over themselves
  on the sgemm torch exports (optionally in a sliding window, with sink logits);
* ``csrc/cpu_linear.cpp``: ``linear_small``, linear layers for a few rows (decode), float32,
  bfloat16 or float16 weights (half weights also with float32 activations), each weight row
  read from memory once.

One library, built against the installed torch (its headers and libraries, no other dependency)
the first time a process asks for it, into a cache directory keyed by the sources, the torch
version and the compiler flags; later processes load the built library (well under a second).
``scripts/setup.sh`` builds it at install time.

* ``PD_RUNTIME_KERNEL_DIR``: the cache directory (default ``$XDG_CACHE_HOME/pd-serving`` or
  ``~/.cache/pd-serving``; a temporary directory when that is not writable).

Without a C++ compiler, or when the build fails, :func:`cpu_ops` (and :func:`paged_decode_op`)
return None and log one warning with the compiler's message; the runtime then runs torch's
own ops (gather + SDPA for decode attention).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().with_name("csrc")  # one cache key however the package was found
# the translation units; the cache key also covers the headers they include (all of csrc/)
SOURCES = [
    CSRC / "cpu_ops.cpp",
    CSRC / "cpu_fused.cpp",
    CSRC / "cpu_prefill.cpp",
    CSRC / "cpu_linear.cpp",
]
BUILD_TIMEOUT_S = 300
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the loaded namespace, or False once loading failed


def cache_dir() -> Path:
    env = os.environ.get("PD_RUNTIME_KERNEL_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pd-serving"


def compile_command(sources: list[Path], output: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = cpp_extension.library_paths()
    return [
        os.environ.get("CXX", "g++"),
        "-O3",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-fopenmp",  # at::parallel_for; resolves to the libgomp torch has loaded
        "-Wno-psabi",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(str(p) for p in sources),
        "-o",
        str(output),
        *(f"-L{p}" for p in libs),
        *(f"-Wl,-rpath,{p}" for p in libs),
        "-lc10",
        "-ltorch_cpu",
    ]


def library_path(directory: Path | None = None) -> Path:
    """Where the library for these sources, torch and command lives (built or not)."""
    directory = directory or cache_dir()
    key = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(compile_command(SOURCES, Path("out"))).encode())
    return directory / f"cpu_ops-{key.hexdigest()[:16]}.so"


def build(directory: Path | None = None) -> Path:
    """Build the library unless it is there; -> its path. Raises RuntimeError with the
    compiler's message on failure. Safe when several processes build at once (each writes its
    own file and renames it into place)."""
    target = library_path(directory)
    if target.exists():
        return target
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        raise RuntimeError("no C++ compiler (g++, or $CXX) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = compile_command(SOURCES, Path(tmp))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"building the CPU kernels failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load():
    try:
        path = build()
    except PermissionError:  # a read-only home
        path = build(Path(tempfile.gettempdir()) / "pd-serving")
    torch.ops.load_library(str(path))
    return torch.ops.pd_runtime


def cpu_ops():
    """The loaded ``torch.ops.pd_runtime`` namespace, or None where it cannot be built."""
    with _lock:
        if "ops" not in _state:
            try:
                _state["ops"] = _load()
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                log.warning("C++ CPU kernels unavailable, using torch's ops and SDPA: %s", e)
                _state["ops"] = False
        return _state["ops"] or None


def paged_decode_op():
    """The loaded ``torch.ops.pd_runtime.paged_decode``, or None where it cannot be built."""
    ops = cpu_ops()
    return None if ops is None else ops.paged_decode

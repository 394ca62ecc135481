"""The runtime's process-wide allocation setting (backends.runtime.host)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backends.runtime import host

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_keep_is_the_default_and_raises_glibc_thresholds(monkeypatch):
    monkeypatch.delenv("PD_RUNTIME_MALLOC", raising=False)
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    assert host.keep_freed_memory() is True


def test_system_leaves_the_c_library_alone(monkeypatch):
    monkeypatch.setenv("PD_RUNTIME_MALLOC", "system")
    assert host.keep_freed_memory() is False


def test_an_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv("PD_RUNTIME_MALLOC", "tcmalloc")
    with pytest.raises(ValueError, match="PD_RUNTIME_MALLOC must be one of"):
        host.keep_freed_memory()


def test_freed_blocks_are_reused_without_page_faults():
    """Blocks of 8 and 48 MiB allocated, written and freed in a loop (a forward's activations; a
    long prefill's MLP output is 48 MiB) fault their pages in once with the default setting, on
    every pass with the C library's."""
    code = (
        "import backends.runtime, ctypes, resource\n"
        "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p\n"
        "libc.free.argtypes = [ctypes.c_void_p]\n"
        "def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "def rnd():\n"
        "    sizes = (8 << 20, 48 << 20, 8 << 20)\n"
        "    ps = [libc.malloc(n) for n in sizes]\n"
        "    for p, n in zip(ps, sizes): ctypes.memset(p, 1, n)\n"
        "    for p in ps: libc.free(p)\n"
        "rnd(); rnd(); before = faults()\n"
        "for _ in range(10): rnd()\n"
        "print(faults() - before)\n"
    )
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    pages = 10 * (64 << 20) // 4096
    for env, refaults in (({}, False), ({"PD_RUNTIME_MALLOC": "system"}, True)):
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={"PATH": "/usr/bin:/bin", **env},
            capture_output=True,
            text=True,
            check=True,
        )
        faults = int(out.stdout.strip())
        assert (faults > pages // 2) is refaults, (env, faults, pages)

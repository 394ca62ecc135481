"""The code's shape: dependency rules between packages, where Triton may be imported, sizes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def py_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Absolute module names a file imports (relative imports resolved against its package)."""
    pkg = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[: len(pkg) - node.level + 1]) if node.level else []
            mod = ".".join([*base, node.module] if node.module else base)
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize(
    "package,forbidden",
    [("backends/runtime", "backends.stages"), ("kvtransfer", "backends")],
)
def test_dependency_rules(package, forbidden):
    bad = {
        str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.startswith(forbidden))
        for p in py_files(package)
    }
    assert not {k: v for k, v in bad.items() if v}, f"{package} must not import {forbidden}"


def test_only_the_glue_and_model_files_import_triton():
    users = [
        str(p.relative_to(ROOT))
        for p in py_files("backends", "kvtransfer", "scripts", "model_repository")
        if "triton_python_backend_utils" in imported_modules(p)
    ]
    allowed = {"backends/stages/triton_glue.py"} | {
        str(p.relative_to(ROOT)) for p in (ROOT / "model_repository").glob("*/1/model.py")
    }
    assert set(users) <= allowed, sorted(set(users) - allowed)
    assert "backends/stages/triton_glue.py" not in users  # it takes `pb` as an argument


def test_the_dependency_check_sees_relative_imports(tmp_path):
    """The rule above must catch `from ..stages import x` inside backends/runtime."""
    f = ROOT / "backends" / "runtime" / "_probe_for_test.py"
    f.write_text("from ..stages import params\n")
    try:
        assert "backends.stages.params" in imported_modules(f)
    finally:
        f.unlink()


def test_files_and_functions_stay_small():
    long_files, long_functions = [], []
    for p in py_files("backends", "kvtransfer"):
        text = p.read_text()
        rel = str(p.relative_to(ROOT))
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append((rel, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append((rel, node.name, n))
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"

"""The code's shape: dependency rules between packages, where Triton may be imported, no import
circles, no class assembled from several in-repo bases (STYLE.md 2 and 3)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("backends", "kvtransfer")


def py_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path):
    """(module, names taken from it) for every import in a file, lazy ones included; relative
    imports resolved against its package (``names`` is empty for ``import module``)."""
    pkg = path.relative_to(ROOT).with_suffix("").parts[:-1]  # a.b for a/b/c.py and a/b/__init__
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[: len(pkg) - node.level + 1]) if node.level else []
            yield (
                ".".join([*base, node.module] if node.module else base),
                [a.name for a in node.names],
            )


def imported_modules(path: Path) -> set[str]:
    """Absolute module names a file imports; ``from pkg import name`` also yields ``pkg.name``."""
    out: set[str] = set()
    for mod, names in imports(path):
        out.add(mod)
        out.update(f"{mod}.{n}" for n in names)
    return out


def import_graph(*dirs: str) -> dict[str, set[str]]:
    """Module -> the product modules it imports. ``from pkg import x`` counts as importing the
    submodule ``pkg.x`` when there is one, and as importing ``pkg`` when some name is not."""
    files = {module_name(p): p for p in py_files(*dirs)}
    graph = {}
    for mod, path in files.items():
        targets = set()
        for name, names in imports(path):
            subs = [f"{name}.{n}" for n in names if f"{name}.{n}" in files]
            targets.update(subs if names and len(subs) == len(names) else [name, *subs])
        graph[mod] = {t for t in targets if t in files and t != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
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


def test_the_stages_and_the_runtime_use_only_the_kvtransfer_face():
    """``from kvtransfer import X``: the package face is the contract, its folders are not."""
    bad = {
        str(p.relative_to(ROOT)): sorted(
            m for m in imported_modules(p) if m.startswith("kvtransfer.") and m.count(".") > 1
        )
        for p in py_files("backends", "model_repository")
    }
    assert not {k: v for k, v in bad.items() if v}


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


def test_no_import_circles_among_product_modules():
    found = circles(import_graph(*PRODUCT))
    assert not found, "import circles (lazy imports count): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_the_circle_check_finds_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    f = ROOT / "kvtransfer" / "_probe_for_test.py"
    f.write_text("def f():\n    from . import roles\n")
    try:
        assert "kvtransfer.roles" in imported_modules(f)
    finally:
        f.unlink()


def in_repo_classes() -> set[str]:
    return {
        node.name
        for p in py_files(*PRODUCT)
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
    }


def test_no_class_has_two_or_more_in_repo_bases():
    """A class owns its state: collaborators are objects passed in, not mixins reaching into
    each other through ``self``."""
    ours = in_repo_classes()
    bad = []
    for p in py_files(*PRODUCT):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                names = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                mine = [n for n in names if n in ours]
                if len(mine) > 1:
                    bad.append(f"{p.relative_to(ROOT)}: {node.name}({', '.join(mine)})")
    assert not bad, bad


def test_every_stage_initialize_ends_with_started():
    """``triton_glue.started`` freezes what a stage built out of the garbage collector's reach
    (no 170 ms collection inside a decode step, a faster unload): it must be the last call of
    every model's ``initialize``, after everything the stage keeps exists."""
    missing = []
    for p in sorted((ROOT / "model_repository").glob("*/1/model.py")):
        init = next(
            f for f in ast.walk(ast.parse(p.read_text()))
            if isinstance(f, ast.FunctionDef) and f.name == "initialize"
        )  # fmt: skip
        last = init.body[-1]
        if ast.unparse(last) != "g.started()":
            missing.append(str(p.relative_to(ROOT)))
    assert not missing, missing

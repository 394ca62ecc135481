"""Prompts around text that ships inside two PyPI packages every torch install has: the
docstrings, doctest examples and short functions of **networkx** (BSD-3-Clause) and **sympy**
(BSD-3-Clause, "New BSD"). Each becomes a user request written here (explain this code, what
does it print, summarize this paragraph, add comments, ...): code and math that a user pastes
into a chat. The source files are parsed (``ast``), not imported; their test folders are skipped.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import re

PACKAGES = {"networkx": "BSD-3-Clause", "sympy": "BSD-3-Clause"}
SKIP_DIRS = {"tests", "testing", "benchmarks", "__pycache__"}

CODE_ASKS = [
    "What does this Python code do?\n\n```python\n{x}\n```",
    "Explain this code line by line:\n\n{x}",
    "What will this print?\n\n```python\n{x}\n```",
    "I found this snippet in a project. Can you explain it?\n\n{x}",
    "Rewrite this so a beginner can follow it:\n\n```python\n{x}\n```",
]
FUNCTION_ASKS = [
    "Explain what this function does:\n\n```python\n{x}\n```",
    "Can you add comments to this function?\n\n```python\n{x}\n```",
    "Is there a bug in this code?\n\n```python\n{x}\n```",
    "How could I make this function easier to read?\n\n{x}",
    "Write a short docstring for this function:\n\n```python\n{x}\n```",
    "What is the time complexity of this function?\n\n```python\n{x}\n```",
]
TEXT_ASKS = [
    "Explain this in simple terms: {x}",
    "Summarize this in one sentence:\n\n{x}",
    "{x}\n\nWhat does this mean?",
    "Can you give an example of what this describes? {x}",
    "Rewrite this paragraph in plain English:\n\n{x}",
]


def _files(package: str) -> list[str]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for d, dirs, files in os.walk(spec.submodule_search_locations[0]):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def _examples(doc: str) -> list[str]:
    """The doctest inputs of a docstring, one snippet per run of ``>>>`` / ``...`` lines."""
    out, run = [], []
    for line in doc.splitlines() + [""]:
        s = line.strip()
        if s.startswith((">>> ", "... ")) or s in (">>>", "..."):
            run.append(s[4:])
        elif run:
            work = [r for r in run if r and not r.startswith(("from ", "import ", "#"))]
            if 2 <= len(run) <= 8 and work and not any("import *" in r for r in run):
                out.append("\n".join(run))
            run = []
    return out


def _paragraph(doc: str) -> str | None:
    """The docstring's first prose paragraph, 60-500 characters, or None."""
    para = " ".join(doc.strip().split("\n\n", 1)[0].split())
    if not 60 <= len(para) <= 500 or re.search(r"[`:]{2}|>>>|\\\\", para):
        return None
    return para


def snippets(package: str) -> dict[str, list[str]]:
    """A package's paragraphs (``text``), doctest snippets (``code``) and functions of 4-16
    lines without their docstring (``function``), in file order."""
    out: dict[str, list[str]] = {"text": [], "code": [], "function": []}
    for path in _files(package):
        with open(path, encoding="utf-8") as f:
            src = f.read()
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            doc = ast.get_docstring(node)
            if doc:
                out["code"] += _examples(doc)
                if (para := _paragraph(doc)) is not None:
                    out["text"].append(para)
            body = node.body[1:] if doc else node.body  # without the docstring
            if isinstance(node, ast.FunctionDef) and body and not node.decorator_list:
                code = lines[node.lineno - 1 : node.lineno]  # the def line
                code += lines[body[0].lineno - 1 : body[-1].end_lineno]
                if 4 <= len(code) <= 16 and sum(map(len, code)) <= 900:
                    out["function"].append(_dedent("\n".join(code)))
    return out


def _dedent(text: str) -> str:
    lines = text.splitlines()
    pad = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
    return "\n".join(x[pad:] for x in lines)


def prompts(n: int, seed: int, packages=tuple(PACKAGES)) -> list[list[dict]]:
    """``n`` distinct one-turn conversations over the packages' snippets (both by default; sympy
    takes 12 s of parsing, networkx under 2): a third code, a third functions, a third prose (as
    far as each lasts)."""
    pools: dict[str, list[str]] = {"text": [], "code": [], "function": []}
    for package in packages:
        for kind, xs in snippets(package).items():
            pools[kind] += xs
    asks = {"text": TEXT_ASKS, "code": CODE_ASKS, "function": FUNCTION_ASKS}
    rng = random.Random(seed)
    for xs in pools.values():
        rng.shuffle(xs)
    out, seen, kinds = [], set(), list(pools)
    i = 0
    while len(out) < n and any(pools.values()):
        kind = kinds[i % len(kinds)]
        i += 1
        if not pools[kind]:
            continue
        x = pools[kind].pop()
        text = rng.choice(asks[kind]).format(x=x)
        if text not in seen:
            seen.add(text)
            out.append([{"role": "user", "content": text}])
    return out

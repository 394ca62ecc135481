#!/usr/bin/env python
"""Regenerate the reference tables in docs/ from the code's own schemas.

* ``docs/configuration.md``: the stage parameters (backends/stages/params.py);
* ``docs/metrics.md``: the stage metrics (backends/stages/metrics.py).

Each file keeps its hand-written text; only the part between the ``<!-- generated -->`` and
``<!-- end generated -->`` markers is replaced. A unit test fails when a file is stale.

    .venv/bin/python scripts/gen_docs.py
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.stages import metrics, params  # noqa: E402

BEGIN, END = "<!-- generated -->\n", "<!-- end generated -->\n"


def splice(path: str, table: str) -> bool:
    """Put ``table`` between the markers of ``path``; True when the file changed."""
    text = open(path).read()
    try:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise SystemExit(f"{path}: missing {BEGIN.strip()} / {END.strip()} markers") from None
    new = head + BEGIN + table + END + tail
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


def main() -> int:
    docs = os.path.join(ROOT, "docs")
    for name, table in (
        ("configuration.md", params.reference_table()),
        ("metrics.md", metrics.reference_table()),
    ):
        changed = splice(os.path.join(docs, name), table)
        print(f"docs/{name}: {'updated' if changed else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

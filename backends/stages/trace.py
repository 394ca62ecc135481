"""Per-request timing records: JSON lines in ``trace_dir`` (off when it is empty).

One file per worker and process. A write that fails (disk full, directory gone) is logged once
and counted, never raised: tracing must not fail a request or kill a stage thread.
"""

from __future__ import annotations

import json
import logging
import os
import threading

log = logging.getLogger(__name__)


class TraceWriter:
    def __init__(self, trace_dir: str, name: str):
        self.path = os.path.join(trace_dir, f"{name}-{os.getpid()}.jsonl") if trace_dir else ""
        self.errors = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def write(self, record: dict) -> None:
        if not self.path:
            return
        try:
            line = json.dumps(record) + "\n"
            with self._lock, open(self.path, "a") as f:
                f.write(line)
        except Exception as e:  # noqa: BLE001 - tracing is best effort by design
            self.errors += 1
            if self.errors == 1:
                log.warning(
                    "trace %s: write failed (%s); further errors are only counted", self.path, e
                )

"""Stopping a stage core's serving thread (the prefill compute thread, the decode loop): wait for
the work it is in, at most a bound; past it the thread is stuck (a hung kernel or rank), and what
it still uses must stay open (closing it under the thread would be a use after close)."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


def stopped(thread: threading.Thread, join_s: float, name: str, keeps: str) -> bool:
    """Wait for ``thread`` (already told to stop) at most ``join_s`` seconds: True once it ended;
    False, logged as an error naming what stays open (``keeps``), while it still runs."""
    thread.join(timeout=join_s)
    if not thread.is_alive():
        return True
    log.error(
        "%s: %s still runs after %gs: its requests end now; %s stay open (it uses them)",
        name,
        thread.name,
        join_s,
        keeps,
    )
    return False

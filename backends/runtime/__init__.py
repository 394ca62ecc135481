"""The model runtime (no Triton): config, weights, layers, attention, KV pool, runner, engine.

Two process-wide settings are applied when this package is imported:

* Threads: unless the environment already chose, OpenMP threads sleep instead of spinning while
  they wait (``OMP_WAIT_POLICY=PASSIVE``). These machines are shared: with spinning threads, a
  2-thread runtime next to other busy processes measured 3x slower prefill and up to 10x slower
  decode (8 x 128 tokens, ``benchmarks.vs_vllm``'s engine path), because every
  parallel region waits for a thread that spins on a core someone else needs. OpenMP reads the
  variable when torch loads, so it only applies where this package is imported before torch
  (the scripts, the Triton stages); ``OMP_WAIT_POLICY=ACTIVE`` in the environment restores
  spinning.
* Memory: see :mod:`backends.runtime.host` (``PD_RUNTIME_MALLOC``).
"""

import os
import sys

from .host import keep_freed_memory

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
keep_freed_memory()

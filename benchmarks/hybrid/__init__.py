"""Hybrid model families under PD (``python -m benchmarks.hybrid``), issue 46 item 6:

* ``shapes``: KV plus state bytes a room moves per prompt token for each family's flagship shape
  (layouts and state slots only, no weights), against the same model all full attention, and
  the bytes a sliding-window entry saves (Gemma 3, gpt-oss);
* ``exposed``: the exposed transfer on the real stage path, each recurrent state sent with its
  layer group (the stages) against every state sent after the last group, over an emulated link;
* ``speed``: the runtime's hybrid prefill and decode tokens/s against transformers;
* ``models``: the random hybrid checkpoints the last two measure; ``report``: the tables.

    .venv/bin/python -m benchmarks.hybrid --quick --json        # about 30 s, CI smoke
    .venv/bin/python -m benchmarks.hybrid --link-gbit 0.2 --runs 20 --out docs/bench/hybrid.json
    .venv/bin/python -m benchmarks.hybrid --from-json docs/bench/hybrid.json   # the tables

The full run took 6 minutes on the 2-core machine at load 1 (root: ``--link-gbit`` runs it in a
network namespace of its own, as benchmarks.ttft does). ``--quick --parts bytes speed`` (no
stage processes) runs in seconds: the unit test's.
"""

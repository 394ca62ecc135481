"""The product on a GPU against the hardware's limits (``python -m benchmarks.gpu_roofline``):
8B-shaped models (Llama-3.1-8B, Qwen3-8B; bfloat16, random weights made on the device) decoded
and prefilled by the runtime, beside transformers on the same weights, as fractions of the
limits measured in the same run.

* **Limits**: device-to-device copy bandwidth (read + write; the H100s lent so far measured
  about 3.0 TB/s) and a large bf16 matmul's TFLOP/s (770-800 there).
* **Decode** with CUDA graphs at batch 1, 8, 32, 128 over 1K and 8K contexts: tokens/s, step
  ms p50 / p99, and ``roofline_fraction`` = bytes a step reads (weights + KV) / step time / copy
  bandwidth. Batch 1 of an 8B model reads 16 GB a step: about 190 tokens/s at 3.0 TB/s.
* **Prefill** 1 x 2048, 8 x 2048, 1 x 16384: tokens/s and ``peak_fraction`` = model FLOPs
  (attention counted) / time / matmul TFLOP/s.
* **transformers** beside each: its own ``generate`` with the static cache, eager, and at batch 1
  also ``torch.compile``'d as generate does it on CUDA (where the image and the budget allow);
  its prefill forward. ``decode_b1_over_transformers`` and ``decode_b32_over_transformers`` (1K
  context) divide by the faster transformers measured at that point.
* **fp8 KV** decode at batch 32 / 8K against the bfloat16 pool; **KV transfer** from CUDA pools
  at 8K tokens (``benchmarks.transfer`` in a child; skipped, and said so, without Mooncake's CUDA
  build) against a plain device-to-host copy of the same bytes.

Without CUDA (or with ``--tiny``) the same code runs tiny shapes of the same families on the CPU
in seconds and prints the same keys (CUDA-only figures are null with the reason under
``skipped``): the CI smoke test. ``--budget-s`` (default 420) bounds the run: what would not fit
(compiles first) is skipped and listed; ``--quick`` measures b1 and b32, two prefills, no compile.
Progress goes to stderr; ``--json`` prints one object, per shape at least ``device``,
``decode_b1_roofline_fraction``, ``prefill_8x2048_peak_fraction``,
``decode_b1_over_transformers``, ``decode_b32_over_transformers``.

    .venv/bin/python -m benchmarks.gpu_roofline --json --out bench_out/gpu_roofline.json
    .venv/bin/python -m benchmarks.gpu_roofline --tiny --json   # CPU, seconds

Parts: ``shapes`` (configs, random weights, bytes and FLOPs), ``limits``, ``ours`` (the
runtime), ``hf`` (transformers), ``timing`` (samples, percentiles, the budget), ``run``.
Imports: torch, transformers and the runtime (which imports kvtransfer's face: msgspec and pyzmq,
carried to a GPU image without them, see docs/benchmarks.md); Mooncake only in the transfer's
child process.
"""

"""Decode steps replayed from CUDA graphs, one per batch-size bucket: the CUDA default for GQA
models (``PD_RUNTIME_CUDA_GRAPHS=0`` turns them off). The first GPU run, on an H100, decoded
4.6-8.5x faster than eager, but every step after a bucket's first was wrong (stale rotary rows);
the second, after the fix, passed test_cuda_graphs.py: graphs == eager == transformers over
bucket changes (see docs/benchmarks.md).

A decode step of B sequences launches a few hundred small kernels whose CPU-side launch cost
exceeds their GPU time at small B. Captured once per bucket (1, 2, 4, ... 64 sequences), a step
is one graph replay. A graph replays fixed addresses and shapes, so every input of the step lives
in static buffers that each step overwrites in place:

* ``ids``, ``positions``, ``write_slots`` [bucket]; ``starts`` [bucket] int32 (= positions);
* ``page_table`` [bucket, P] int32, P = ``max_pages`` per sequence (wider tables run eagerly);
* ``cu_q`` [bucket + 1] = 0, 1, ..., bucket: one query each.

Rows past B (padding up to the bucket) decode a dummy token at position 0 of a scratch page the
graphs hold for themselves (taken from the pool once; nothing else reads it), so their KV writes
touch no sequence's pages. A model with a sliding-window entry (``pool.window``: Gemma 3,
gpt-oss) has a second ``window_table`` and ``window_write_slots`` for it, the batch its sliding
layers attend through (``BatchMeta.window_batch``); its padding rows write to the window pool's
placeholder page (which no layer reads), or with no window tables given (each sequence's pages
serve both entries) to the same scratch page id.

Attention goes through the Triton kernel, which reads only these buffers (the key splits are
fixed by ``max_pages``: empty splits cost an early exit).

Only models whose step has no host synchronisation can be captured: GQA models (the MoE layers
of DeepSeek count tokens per expert on the host; the runner does not try them). A capture that
fails logs one warning and the runner stays eager. ``graph_factory`` lets the tests replace
CUDA graphs with plain re-execution on CPU (interpreted Triton), which checks the static-buffer
plumbing without a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace

import torch

from . import cuda_attn
from .paged import BatchMeta

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def graphs_requested() -> bool:
    return os.environ.get("PD_RUNTIME_CUDA_GRAPHS", "1") != "0"


def cuda_graph_factory(device: torch.device) -> Callable[[Callable[[], torch.Tensor]], tuple]:
    """capture(fn) -> (replay, out): fn captured into a CUDA graph after two warm-up runs on a
    side stream (kernels compile, the allocator settles); ``out`` is fn's output buffer."""
    mempool = torch.cuda.graph_pool_handle()

    def capture(fn):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a KV transfer's copies) during the capture
        # neither fail nor join it
        with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out

    return capture


class DecodeGraphs:
    """Captured decode steps of one runner over one pool."""

    def __init__(self, runner, pool, max_pages: int, graph_factory=None):
        self.runner, self.pool, self.max_pages = runner, pool, max_pages
        dev = runner.device
        self.capture = graph_factory or cuda_graph_factory(dev)
        self.scratch_page = pool.take_scratch()
        n = BUCKETS[-1]
        i32 = dict(dtype=torch.int32, device=dev)
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.write_slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.starts = torch.zeros(n, **i32)
        self.page_table = torch.zeros(n, max_pages, **i32)
        self.cu_q = torch.arange(n + 1, **i32)
        if pool.window is not None:  # the sliding layers' entry: its own slots and table
            self.window_write_slots = torch.zeros(n, dtype=torch.long, device=dev)
            self.window_table = torch.zeros(n, max_pages, **i32)
        self.graphs: dict[int, tuple] = {}
        self.failed = False

    def _meta(self, bucket: int) -> BatchMeta:
        ps = self.pool.page_size
        max_ctx = self.max_pages * ps
        meta = BatchMeta(
            kind="decode",
            positions=self.positions[:bucket],
            write_slots=self.write_slots[:bucket],
            # shape only (the Triton path sizes its key splits from it); never read
            read_slots=self.ids.new_zeros(1, 1).expand(bucket, max_ctx),
            ctx_lens=self.positions[:bucket],  # unused on the Triton path
            q_index=self.ids[:bucket],  # unused on the Triton path
            mask=None,
            lengths=[1] * bucket,
            num_seqs=bucket,
            max_q=1,
            page_size=ps,
            page_table=self.page_table[:bucket],
            starts=self.starts[:bucket],
        )
        meta.cu_q = self.cu_q[: bucket + 1]
        cfg = self.runner.config
        windows = {cfg.layer_window(i) for i in range(cfg.num_layers)} - {None}
        seen = meta
        if self.pool.window is not None:  # the sliding layers attend through this batch
            seen = meta.window_batch = replace(
                meta,
                write_slots=self.window_write_slots[:bucket],
                page_table=self.window_table[:bucket],
                views={},
            )
            seen.cu_q = meta.cu_q
        for window in windows:
            # each windowed layer's view (BatchMeta.for_window) made here, on the same static
            # buffers: the Triton kernel reads only its window, page table and starts (and
            # sizes its key splits from read_slots: a decode step reads at most window keys)
            view = replace(seen, window=window, read_slots=seen.read_slots[:, :window], views={})
            view.cu_q = meta.cu_q
            seen.views[window] = view
        return meta

    def _table(self, bucket: int, tables, pad: int, pos: torch.Tensor):
        """-> (the page table [bucket, max_pages] int32, padded with page ``pad``; each row's
        write slot [bucket] at ``pos``)."""
        ps = self.pool.page_size
        table = torch.full((bucket, self.max_pages), pad, dtype=torch.int32)
        for b, pages in enumerate(tables):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        page_of = table[torch.arange(bucket), pos // ps].long()
        return table, page_of * ps + pos % ps

    def _step_fn(self, bucket: int) -> Callable[[], torch.Tensor]:
        meta, model, pool = self._meta(bucket), self.runner.model, self.pool
        layers = self.runner.config.num_layers

        def step() -> torch.Tensor:
            # a new view of the positions each step: a per-forward lookup keyed on that tensor
            # (RotaryEmbedding.rows) runs again, inside the graph, instead of reusing the first
            # step's rows (found on an H100: every step after a bucket's first was wrong)
            meta.positions = self.positions[:bucket]
            if meta.window_batch is not None:
                meta.window_batch.positions = meta.positions
            # model.embed checks the ids on the host (a sync, not capturable): run() checks them
            h = model.embed_rows(self.ids[:bucket])  # [bucket, hidden]
            window = None if pool.window is None else pool.window.tensor
            h = model.run_layers(h, meta, pool.tensor, 0, layers, None, window)
            return model.logits(h)  # [bucket, vocab] float32

        return step

    def run(self, tokens, positions, page_tables, window_tables=None) -> torch.Tensor | None:
        """Logits [B, vocab], or None where this step runs eagerly (too many sequences or
        pages, or capture failed). ``window_tables``: each sequence's page table in
        ``pool.window`` (None: its ``page_tables``, see ``SeqInput.window_pages``)."""
        B = len(tokens)
        if self.failed or B > BUCKETS[-1] or max(map(len, page_tables)) > self.max_pages:
            return None
        if not all(0 <= t < self.runner.config.vocab_size for t in tokens):
            return None  # the eager path raises the error
        window = self.pool.window
        if window is not None and window_tables is None and not window.untouched:
            return None  # the eager path raises the error
        if window_tables is not None and max(map(len, window_tables)) > self.max_pages:
            return None
        bucket = next(b for b in BUCKETS if b >= B)
        pos = torch.tensor(list(positions) + [0] * (bucket - B))
        table, write_slots = self._table(bucket, page_tables, self.scratch_page, pos)
        host = dict(
            ids=torch.tensor(list(tokens) + [0] * (bucket - B)),
            positions=pos,
            write_slots=write_slots,
            starts=pos.to(torch.int32),
            page_table=table,
        )
        if window is not None:
            if window_tables is None:  # the same page ids in both entries
                host.update(window_table=table, window_write_slots=write_slots)
            else:
                wtable, wslots = self._table(bucket, window_tables, window.placeholder(), pos)
                host.update(window_table=wtable, window_write_slots=wslots)
        for name, value in host.items():  # into the static buffers, in place
            buf = getattr(self, name)[:bucket]
            buf.copy_(value.to(buf.dtype), non_blocking=True)
        if bucket not in self.graphs:
            try:
                captured = self.capture(self._step_fn(bucket))
            except Exception as e:  # a host sync in the model, an unsupported op, ...
                log.warning("CUDA graph capture failed, decoding eagerly: %s", e)
                self.failed = True
                return None
            if not cuda_attn.kernels_ok():  # the capture fell back to gather + SDPA
                log.warning("CUDA graphs need the Triton attention; decoding eagerly")
                self.failed = True
                return None
            self.graphs[bucket] = captured
        replay, out = self.graphs[bucket]
        replay()
        return out[:B].clone()

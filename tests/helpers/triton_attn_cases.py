"""Cases for the Triton paged-attention kernels under the interpreter, run in a process of
their own (``tests/unit/test_triton_attn.py`` starts it): ``TRITON_INTERPRET`` must be set before
``triton`` is first imported, and no other test should see interpreted kernels.

Run as a script (with ``TRITON_INTERPRET=1``): executes every case of :data:`SUITE` against the
dense float64 reference and prints one JSON object, case name -> {"error": None or the
assert_close message, "max_err": float, "seconds": float}.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

CASES = {  # (start, new tokens) per sequence
    "decode": [(7, 1), (20, 1), (0, 1), (33, 1)],
    "prefill": [(0, 9), (0, 3), (0, 17)],
    "extend": [(5, 4), (17, 3), (0, 6), (30, 1)],
    "longdecode": [(99, 1), (3, 1), (70, 1)],
}


def build(seqs, page_size, hkv, dk, dv, dtype, mla=False, seed=0):
    """Random caches and q; each sequence's pages drawn from a shuffled pool."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(s + n) // page_size) for s, n in seqs]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages, generator=g).tolist()
    width = max(need)
    table, used = [], 0
    for k in need:
        table.append(order[used : used + k] + [0] * (width - k))
        used += k
    S = num_pages * page_size
    k_cache = torch.randn(S, hkv, dk, generator=g)
    v_cache = None if mla else torch.randn(S, hkv, dv, generator=g)
    T = sum(n for _, n in seqs)
    cu = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)
    return dict(
        k_cache=k_cache.to(dtype) if dtype != torch.float8_e4m3fn else k_cache,
        v_cache=v_cache,
        page_table=torch.tensor(table, dtype=torch.int32),
        cu_q=cu.to(torch.int32),
        starts=torch.tensor([s for s, _ in seqs], dtype=torch.int32),
        max_q=max(n for _, n in seqs),
        T=T,
    )


def reference(q, k_cache, v_cache, page_table, cu_q, starts, page_size, scale, v_dim, window,
              k_scale=1.0, v_scale=1.0, sinks=None):  # fmt: skip
    """Dense float64: every sequence's context gathered slot by slot, masked softmax (with a
    sink logit per head in its denominator where ``sinks`` [H] is given)."""
    q = q.double()
    H = q.shape[1]
    out = torch.zeros(q.shape[0], H, v_dim if v_cache is None else v_cache.shape[2],
                      dtype=torch.float64)  # fmt: skip
    for b in range(len(starts)):
        q0, q1, start = int(cu_q[b]), int(cu_q[b + 1]), int(starts[b])
        ctx = start + q1 - q0
        pos = torch.arange(ctx)
        slots = page_table[b].long()[pos // page_size] * page_size + pos % page_size
        k = k_cache[slots].double() * k_scale  # [L, Hkv, Dk]
        v = k[..., :v_dim] if v_cache is None else v_cache[slots].double() * v_scale
        G = H // k.shape[1]
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # [L, H, D]
        s = torch.einsum("thd,lhd->htl", q[q0:q1], k) * scale
        qpos = start + torch.arange(q1 - q0)
        seen = pos[None, :] <= qpos[:, None]
        if window:
            seen &= pos[None, :] > qpos[:, None] - window
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is None:
            p = torch.softmax(s, -1)
        else:
            sink = sinks.double()[:, None, None]  # [H, 1, 1]
            m = torch.maximum(s.amax(-1, keepdim=True), sink)
            e = (s - m).exp()
            p = e / (e.sum(-1, keepdim=True) + (sink - m).exp())
        out[q0:q1] = torch.einsum("htl,lhd->thd", p, v)
    return out


def run_case(ta, case, page_size, H, hkv, dk, dv, window, dtype=torch.float32, mla=False,
             kv_dtype=None, scales=(1.0, 1.0), seed=0, splits=None, device="cpu",
             sinks=False):  # fmt: skip
    seqs = CASES[case]
    a = build(seqs, page_size, hkv, dk, dv, dtype, mla, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(a["T"], H, dk, generator=g).to(dtype)
    k_cache, v_cache = a["k_cache"], a["v_cache"]
    if kv_dtype is not None:  # fp8 storage: the kernel dequantizes with the scales
        k_cache = (k_cache.float() / scales[0]).to(kv_dtype)
        v_cache = None if v_cache is None else (v_cache / scales[1]).to(kv_dtype)
    elif v_cache is not None:
        v_cache = v_cache.to(dtype)
    scale = dk**-0.5
    sink = torch.linspace(-2.0, 3.0, H) if sinks else None  # [H] float32
    on = {n: t.to(device) for n, t in a.items() if isinstance(t, torch.Tensor)}
    out = ta.paged_attention(
        q.to(device), k_cache.to(device), None if v_cache is None else v_cache.to(device),
        on["page_table"], on["cu_q"], on["starts"], a["max_q"], page_size,
        scale, v_dim=dv if mla else None, rope_dim=dk - dv if mla else 0, window=window,
        k_scale=scales[0], v_scale=scales[1], max_ctx=max(st + n for st, n in seqs),
        num_splits=splits, sinks=None if sink is None else sink.to(device),
    )  # fmt: skip
    ref = reference(
        q, k_cache.float() if kv_dtype else k_cache,
        None if v_cache is None else (v_cache.float() if kv_dtype else v_cache),
        a["page_table"], a["cu_q"], a["starts"], page_size, scale, dv, window, *scales, sink,
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == ref.shape
    return out.cpu().double(), ref


def suite() -> dict[str, tuple[dict, float]]:
    """name -> (run_case keyword arguments, tolerance)."""
    s: dict[str, tuple[dict, float]] = {}
    for case in sorted(CASES):
        for ps in (1, 16):
            for w in (None, 5):
                s[f"gqa-{case}-page{ps}-window{w}"] = (
                    dict(case=case, page_size=ps, H=6, hkv=2, dk=16, dv=16, window=w),
                    1e-5,
                )
            s[f"mla-{case}-page{ps}"] = (
                dict(case=case, page_size=ps, H=4, hkv=1, dk=48, dv=32, window=None, mla=True),
                1e-5,
            )
    for case in ("decode", "extend"):
        # 24 channels (masked lanes), 7 query heads on one KV head; window 1 (only itself)
        s[f"gqa-{case}-dim24-group7"] = (
            dict(case=case, page_size=16, H=7, hkv=1, dk=24, dv=24, window=None),
            1e-5,
        )
        s[f"gqa-{case}-page4-window1"] = (
            dict(case=case, page_size=4, H=4, hkv=4, dk=16, dv=16, window=1),
            1e-5,
        )
        # fp8 K/V with per-layer scales; the reference dequantizes the same fp8 values
        fp8 = dict(kv_dtype=torch.float8_e4m3fn, scales=(0.05, 0.02))
        s[f"fp8-gqa-{case}"] = (
            dict(case=case, page_size=16, H=6, hkv=2, dk=16, dv=16, window=None, **fp8),
            1e-5,
        )
        s[f"fp8-mla-{case}"] = (
            dict(case=case, page_size=16, H=4, hkv=1, dk=48, dv=32, window=None, mla=True, **fp8),
            1e-5,
        )
    # decode with the keys split over programs (flash-decoding) and merged by a second kernel:
    # split length rounds to 64-key blocks, so 2 splits over contexts of up to 100 keys
    for ps, w in ((1, None), (16, 5), (16, None)):
        s[f"gqa-longdecode-page{ps}-window{w}-split"] = (
            dict(case="longdecode", page_size=ps, H=6, hkv=2, dk=16, dv=16, window=w, splits=4),
            1e-5,
        )
    s["mla-longdecode-split"] = (
        dict(case="longdecode", page_size=16, H=4, hkv=1, dk=48, dv=32, window=None, mla=True,
             splits=2),
        1e-5,
    )  # fmt: skip
    for case in ("decode", "extend"):  # 32 heads on a 512 + 64 latent: 2 head groups of 16
        s[f"mla-{case}-heads32-latent512"] = (
            dict(case=case, page_size=16, H=32, hkv=1, dk=576, dv=512, window=None, mla=True),
            1e-5,
        )
    s["fp8-float16-gqa-longdecode-split"] = (
        dict(case="longdecode", page_size=16, H=6, hkv=2, dk=16, dv=16, window=None, splits=3,
             dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, scales=(0.05, 0.02)),
        3e-3,
    )  # fmt: skip
    for name, dt, tol in (("float16", torch.float16, 3e-3), ("bfloat16", torch.bfloat16, 2e-2)):
        s[f"{name}-gqa-extend-window5"] = (
            dict(case="extend", page_size=16, H=6, hkv=2, dk=16, dv=16, window=5, dtype=dt),
            tol,
        )
        s[f"{name}-mla-decode-page1"] = (
            dict(case="decode", page_size=1, H=4, hkv=1, dk=48, dv=32, window=None, dtype=dt,
                 mla=True), tol,
        )  # fmt: skip
    # attention sinks (gpt-oss): after the last key block, or in the combine kernel (split)
    for case, w in (("prefill", None), ("extend", 5), ("decode", 5)):
        s[f"sinks-gqa-{case}-window{w}"] = (
            dict(case=case, page_size=4, H=6, hkv=2, dk=16, dv=16, window=w, sinks=True),
            1e-5,
        )
    s["sinks-gqa-longdecode-window5-split"] = (
        dict(case="longdecode", page_size=16, H=6, hkv=2, dk=16, dv=16, window=5, splits=4,
             sinks=True), 1e-5,
    )  # fmt: skip
    s["sinks-bfloat16-gqa-extend"] = (
        dict(case="extend", page_size=16, H=6, hkv=2, dk=16, dv=16, window=None, sinks=True,
             dtype=torch.bfloat16), 2e-2,
    )  # fmt: skip
    s["fp8-float16-gqa-extend"] = (
        dict(case="extend", page_size=16, H=6, hkv=2, dk=16, dv=16, window=None,
             dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, scales=(0.05, 0.02)), 3e-3,
    )  # fmt: skip
    return s


# GQA, GQA + sliding window 16, MLA; per-layer windows + sinks (gpt-oss)
RUNTIME_KINDS = ("llama", "mistral", "deepseek_v3", "gpt_oss")


def count_kernel_calls() -> list:
    """Route the runtime's attention to the Triton kernel on CPU tensors too, and count its
    calls: one entry a call in the returned list."""
    from backends.runtime import cuda_attn

    cuda_attn.DEVICE_TYPES = ("cuda", "cpu")
    calls = []
    kernel = cuda_attn._kernels().paged_attention

    def counted(*a, **kw):
        calls.append(1)
        return kernel(*a, **kw)

    cuda_attn._module.paged_attention = counted
    return calls


def runtime_cases(calls: list) -> dict[str, dict]:
    """Tiny models through the runtime with every attention call on the Triton kernel (the CUDA
    path, here interpreted on CPU tensors): prefill logits, a prefill in two chunks (the second
    one attends to pages written by the first), and greedy decode, against transformers.
    -> name -> {"error": ..., "seconds": ...}."""
    import runtime_models as rm

    from backends.runtime.engine import LLMEngine
    from backends.runtime.loader import load_runner
    from backends.runtime.paged import SeqInput
    from backends.runtime.sampling_params import SamplingParams

    results = {}
    for kind in RUNTIME_KINDS:
        t0, err = time.perf_counter(), None
        try:
            runner = load_runner(rm.checkpoint(kind))
            prompt = rm.random_prompt(21, seed=1)  # > the window of 16
            with torch.no_grad():
                ref = rm.hf_model(kind)(torch.tensor([prompt])).logits[0].float()
            pool = runner.make_pool(16, 4)
            pool.shuffle_free_list(seed=3)
            pages = pool.alloc(pool.pages_needed(len(prompt)))
            n0 = len(calls)
            (logits,) = runner.forward(pool, [SeqInput(prompt, 0, pages)])
            assert len(calls) - n0 == runner.config.num_layers, "the kernel did not run"
            rm.assert_close_to_reference(logits, ref)
            pool2 = runner.make_pool(16, 4)
            pages2 = pool2.alloc(6)
            (a,) = runner.forward(pool2, [SeqInput(prompt[:13], 0, pages2)])
            (b,) = runner.forward(pool2, [SeqInput(prompt[13:], 13, pages2)])
            rm.assert_close_to_reference(torch.cat([a, b]), ref)
            want = rm.hf_greedy(kind, prompt[:9], 10)
            engine = LLMEngine(runner, runner.make_pool(16, 4), max_batch=2)
            seqs = engine.generate(
                [
                    (prompt[:9], SamplingParams(max_tokens=10)),
                    (prompt, SamplingParams(max_tokens=3)),
                ]
            )
            assert seqs[0].output_ids == want, (seqs[0].output_ids, want)
        except AssertionError as e:
            err = str(e) or repr(e)
        results[f"runtime-{kind}"] = _verdict(err, t0)
    return results


GRAPH_KINDS = ("llama", "mistral")
FP8_KINDS = ("mistral", "deepseek_v3")  # GQA with a sliding window, MLA


def _fp8_logits(runner, prompt: list[int]) -> torch.Tensor:
    """A prompt in two chunks then one decode step, on a fresh fp8 pool: the second chunk and
    the step read the first one's fp8 pages. -> the logits of all three, concatenated."""
    from backends.runtime.paged import SeqInput

    pool = runner.make_pool(16, 4)
    pool.shuffle_free_list(seed=4)
    pages = pool.alloc(7)
    (a,) = runner.forward(pool, [SeqInput(prompt[:13], 0, pages)])
    (b,) = runner.forward(pool, [SeqInput(prompt[13:], 13, pages)])
    c = runner.decode(pool, [prompt[0]], [len(prompt)], [pages])
    return torch.cat([a, b, c])


def fp8_cases(calls: list) -> dict[str, dict]:
    """fp8 KV through the Triton kernel (dequantized in the kernel with the layer's scales)
    against the CPU path over the same fp8 pages (SDPA on dequantized rows, the C++ decode
    kernel)."""
    import runtime_models as rm

    from backends.runtime import cuda_attn
    from backends.runtime.loader import load_runner

    results = {}
    for kind in FP8_KINDS:
        t0, err = time.perf_counter(), None
        try:
            runner = load_runner(rm.checkpoint(kind), kv_cache_dtype="float8_e4m3fn")
            prompt = rm.random_prompt(21, seed=2)
            n0 = len(calls)
            got = _fp8_logits(runner, prompt)
            assert len(calls) - n0 == 3 * runner.config.num_layers, "the kernel did not run"
            cuda_attn.DEVICE_TYPES = ("cuda",)
            try:
                want = _fp8_logits(runner, prompt)
            finally:
                cuda_attn.DEVICE_TYPES = ("cuda", "cpu")
            # float32 summation orders differ (the interpreter against SDPA / the C++ kernel):
            # seen 1.15e-4 on one logit of 5,632 on an AVX-512 host; a wrong scale or page is
            # off by orders of magnitude more
            torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-3)
        except AssertionError as e:
            err = str(e) or repr(e)
        results[f"fp8-runtime-{kind}"] = _verdict(err, t0)
    return results


def _verdict(err: str | None, t0: float) -> dict:
    """A pass / fail case's result row (no numeric error to report)."""
    return {"error": err, "max_err": 0.0, "ref_max": 1.0, "seconds": time.perf_counter() - t0}


def graph_cases(calls: list) -> dict[str, dict]:
    """Decode steps through :class:`backends.runtime.cuda_graphs.DecodeGraphs` with a stand-in
    for CUDA graphs (capture = run once, replay = run again into the same output): the static
    buffers, the bucket padding (3 sequences in the bucket of 4, the 4th on the scratch page)
    and the Triton attention on them give transformers' greedy tokens; with the fused C++ ops
    and with torch's (``-torch-ops``: the rotary rows looked up per forward, as on CUDA).
    ``graphs-llama-fallback``: the Triton kernels fail during the first capture (attention falls
    back to gather + SDPA, which the graphs' buffers do not serve): the runner decodes eagerly."""
    results = {}
    for kind, fused in [(k, f) for k in GRAPH_KINDS for f in ("auto", "torch")]:
        name = f"graphs-{kind}" + ("-torch-ops" if fused == "torch" else "")
        results[name] = _graph_case(kind, fused, fallback=False)
    results["graphs-llama-fallback"] = _graph_case("llama", "auto", fallback=True)
    # per-layer windows (the views made on the graphs' buffers), the embedding multiplier
    results["graphs-gemma3"] = _graph_case("gemma3", "auto", fallback=False)
    return results


def _graph_case(kind: str, fused: str, fallback: bool) -> dict:
    import runtime_models as rm

    from backends.runtime import attention, cuda_attn
    from backends.runtime.engine import LLMEngine
    from backends.runtime.loader import load_runner
    from backends.runtime.sampling_params import SamplingParams

    captured = []

    def fake_capture(fn):
        if fallback:
            cuda_attn._module = False  # as a failed kernel compile leaves it
        out = fn()
        captured.append(len(out))
        return (lambda: out.copy_(fn())), out

    t0, err, module = time.perf_counter(), None, cuda_attn._module
    cpu_decode = attention.cpu_decode_attention
    if fallback:  # as on CUDA, where the CPU kernel declines: gather + SDPA runs, no error
        attention.cpu_decode_attention = lambda *a, **k: None
    try:
        os.environ["PD_RUNTIME_FUSED"] = fused
        runner = load_runner(rm.checkpoint(kind))
        runner.use_graphs, runner.graph_factory = True, fake_capture
        prompts = [rm.random_prompt(n, seed=n) for n in (5, 19, 9)]
        pool = runner.make_pool(24, 4)
        pool.shuffle_free_list(seed=2)
        engine = LLMEngine(runner, pool, max_batch=4)
        steps = (8, 3, 8)  # one sequence ends early: buckets 4, then 2
        reqs = [(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, steps, strict=True)]
        seqs = engine.generate(reqs)
        graphs = runner._graphs[id(pool)]
        want_buckets = [] if fallback else [2, 4]  # 3 seqs, then 2 left
        assert sorted(graphs.graphs) == want_buckets, sorted(graphs.graphs)
        assert graphs.failed == fallback and captured, (graphs.failed, captured)
        for p, n, seq in zip(prompts, steps, seqs, strict=True):
            want = rm.hf_greedy(kind, p, n)
            assert seq.output_ids == want, (kind, seq.output_ids, want)
        # the scratch page, held by the graphs, is not in use by any sequence
        assert pool.num_free == 24 - 1 and pool.pages_in_use == 0, pool.pages_in_use
    except AssertionError as e:
        err = str(e) or repr(e)
    finally:
        os.environ.pop("PD_RUNTIME_FUSED")
        cuda_attn._module, attention.cpu_decode_attention = module, cpu_decode
    return _verdict(err, t0)


def kernel_cases(ta) -> dict[str, dict]:
    results = {}
    for name, (kw, tol) in suite().items():
        t0 = time.perf_counter()
        out, ref = run_case(ta, **kw)
        err = None
        try:
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        except AssertionError as e:
            err = str(e)
        results[name] = {
            "error": err,
            "max_err": float((out - ref).abs().max()),
            "ref_max": float(ref.abs().max()),
            "seconds": time.perf_counter() - t0,
        }
    return results


# the parts a process can run (argv: their names; none: all); tests/unit/test_triton_attn.py
# runs each in a process of its own, at once
PARTS = ("kernels", "models", "graphs")


def main() -> None:
    import importlib.util

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    path = os.path.join(root, "backends", "runtime", "triton_attn.py")
    spec = importlib.util.spec_from_file_location("triton_attn", path)
    ta = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ta)
    parts = sys.argv[1:] or PARTS
    results = {}
    if "kernels" in parts:
        results.update(kernel_cases(ta))
    if "models" in parts or "graphs" in parts:
        calls = count_kernel_calls()
        if "models" in parts:
            results.update(runtime_cases(calls))
            results.update(fp8_cases(calls))
        if "graphs" in parts:
            results.update(graph_cases(calls))
    print(json.dumps(results))


if __name__ == "__main__":
    main()

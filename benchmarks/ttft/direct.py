"""Direct mode: submit requests to the prefill and decode stage processes and time the first token.

TTFT of a request = submit -> decode has the first token with the KV landed (it can run its
first step); colocated: submit -> prefill sampled the first token (no transfer at all).
``first_token_ms``: submit -> the client got the first token, which prefill sends on the control
plane as soon as it is sampled (before the KV landed); colocated: the same as TTFT. Every
request of a batch is submitted at once (concurrency = batch size); prefill serves them FIFO.
"""

from __future__ import annotations

import itertools
import time

from backends.stages.params import StageParams

from .analysis import mode_groups
from .workers import Stage

PAGE_SIZE = StageParams.page_size  # the serving default


class DirectBench:
    """Prefill + decode stage processes of one model, kept for the whole sweep."""

    def __init__(
        self,
        model_path: str,
        max_tokens_in_flight: int,
        threads: int = 1,
        log_dir: str | None = None,
        device: str = "cpu",
        extra: dict | None = None,  # more stage parameters (both stages)
    ):
        pages = -(-max_tokens_in_flight // PAGE_SIZE) + 64
        self.prefill = Stage(
            "prefill", model_path, PAGE_SIZE, pages, threads, log_dir, device, extra
        )
        self.decode = Stage("decode", model_path, PAGE_SIZE, pages, 1, log_dir, device, extra)
        self.num_layers = self.prefill.info["num_layers"]
        self._rooms = itertools.count(1)
        self.reference: dict[tuple, int] = {}  # (prompt) -> colocated first token

    def close(self) -> None:
        self.prefill.stop()
        self.decode.stop()

    def run(self, mode: str, prompts: list[list[int]]) -> list[dict]:
        """Submit ``prompts`` at once in ``mode``; one record per request."""
        reqs = []
        for ids in prompts:
            groups = mode_groups(mode, len(ids), self.num_layers)
            reqs.append({"room": next(self._rooms), "ids": ids, "groups": groups})
        transfer = mode != "colocated"
        t_submit = time.time()
        if transfer:  # decode registers concurrently with prefill, as the ensemble fans out
            rooms = [(r["room"], r["ids"]) for r in reqs]
            addr = self.prefill.info["bootstrap_addr"]
            self.decode.send("register", {"rooms": rooms, "bootstrap_addr": addr})
        self.prefill.send("run", reqs)
        pre = {r["room"]: r for r in self.prefill.recv()}
        dec = self.decode.recv() if transfer else {}
        stats = self.prefill.call("stats", list(pre)) if transfer else {}
        out = []
        for req in reqs:
            room, p = req["room"], pre[req["room"]]
            key = (len(req["ids"]), hash(tuple(req["ids"])))
            if not transfer:
                self.reference[key] = p["first_token"]
            rec = {
                "mode": mode,
                "room": room,
                "groups": len(req["groups"]) if req["groups"] else 0,
                "queue_ms": (p["t_start"] - t_submit) * 1e3,
                "compute_ms": (p["t_first_token"] - p["t_start"]) * 1e3,
                # CPU the compute thread got, and what other threads of prefill burnt meanwhile
                "compute_cpu_ms": p["compute_cpu_ms"],
                "other_cpu_ms": p["other_cpu_ms"],
            }
            if transfer:
                d = dec[room]
                if d["status"] != "Success":
                    raise RuntimeError(f"room {room} ({mode}) ended {d['status']}: {d['reason']}")
                rec["ttft_ms"] = (d["t_done"] - t_submit) * 1e3
                rec["first_token_ms"] = (d["t_first"] - t_submit) * 1e3
                rec["tail_ms"] = (d["t_done"] - p["t_first_token"]) * 1e3
                rec["t_start"] = p["t_start"]  # time.time() of the prefill stage
                rec["group_end_ms"] = [(t - p["t_start"]) * 1e3 for t in p["group_end"]]
                rec["first_token"] = d["first_token"]
                rec.update(_wire(stats.get(room), p, d["t_done"]))
            else:
                rec["ttft_ms"] = (p["t_first_token"] - t_submit) * 1e3
                rec["first_token_ms"] = rec["ttft_ms"]
                rec["first_token"] = p["first_token"]
            ref = self.reference.get(key)
            rec["tokens_match"] = ref is None or ref == rec["first_token"]
            out.append(rec)
        return out


def _wire(st: dict | None, p: dict, t_done: float) -> dict:
    """Transfer profile of one room: bytes, wire time, achieved rate, per-group timeline."""
    if not st or not st["groups"]:
        return {"wire_gbps": None, "timeline": None}
    gs = st["groups"]
    t0 = p["t_start"]
    first = min(g["submitted"] for g in gs)
    last = max(g["done"] or 0.0 for g in gs)
    wire = last - first
    timeline = [
        {
            "layers": g["layers"],
            "compute_end_ms": (ce - t0) * 1e3,
            "submitted_ms": (g["submitted"] - t0) * 1e3,
            "landed_ms": None if g["done"] is None else (g["done"] - t0) * 1e3,
            "mb": g["nbytes"] / 1e6,
        }
        for g, ce in zip(gs, p["group_end"], strict=False)
    ]
    return {
        "nbytes": st["nbytes"],
        "wire_ms": wire * 1e3,
        "wire_gbps": st["nbytes"] * 8 / wire / 1e9 if wire > 0 else None,
        "complete_after_last_write_ms": (t_done - last) * 1e3,
        "timeline": timeline,
    }

"""Prefill and decode stages as separate OS processes, for the direct (no Triton) TTFT runs.

Each process runs the real stage core the Triton models run:

* prefill: a :class:`~backends.stages.prefill.PrefillWorker`; per request ``prefill_one`` with
  the mode's layer groups (allocate pages, ``start_room``, groups with ``send_group`` after each,
  first token, ``finish``). Requests run one after another (one compute stream). Colocated
  mode: the same worker's runner prefills into its own pool, with no room and no transfer.
* decode: a :class:`~backends.stages.decode.DecodeWorker`; every request is submitted with
  ``max_tokens=1`` while prefill computes (as the ensemble fans out), so its one event is "decode
  has the first token with the prompt's KV landed".

Times are ``time.time()`` (the same clock in every process).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback

STAGE = dict(bootstrap_timeout_s=120.0, transfer_timeout_s=600.0, max_batch=64)


def _params(model: str, page_size: int, num_pages: int, device: str, extra: dict):
    from backends.runtime.config import ModelConfig
    from backends.stages.params import StageParams

    ctx = ModelConfig.from_pretrained(model).max_position_embeddings
    return StageParams(
        model_dir=model,
        page_size=page_size,
        num_pages=num_pages,
        max_context=ctx,
        max_tokens_limit=ctx - 1,
        device=device,
        **{**STAGE, **extra},
    )


def _serve(conn, make, handlers, log_path: str | None) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    if log_path:  # Mooncake logs every batch at INFO on stderr: keep the progress bar readable
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        state = make()
        conn.send(("ok", state["info"]))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "exit":
                state["worker"].close()
                conn.send(("ok", None))
                break
            conn.send(("ok", handlers[cmd](state, arg)))
        except Exception:
            conn.send(("err", traceback.format_exc()))


# ---- prefill ---------------------------------------------------------------------------------
def _prefill_make(model, page_size, num_pages, threads, device, extra) -> dict:
    import torch

    from backends.stages.prefill import PrefillWorker

    torch.set_num_threads(threads)
    worker = PrefillWorker(_params(model, page_size, num_pages, device, extra))
    info = {"bootstrap_addr": worker.bootstrap_addr, "num_layers": worker.runner.config.num_layers}
    return {"worker": worker, "info": info}


def _prefill_one(state: dict, req: dict) -> dict:
    from backends.runtime.sampling_params import SamplingParams
    from backends.stages.request import StageRequest

    worker, room, ids, groups = state["worker"], req["room"], req["ids"], req["groups"]
    rec: dict = {"room": room, "t_start": time.time(), "group_end": []}
    # CPU seconds: this (compute) thread vs the whole process (the rest = transfer/control)
    cpu0 = (time.thread_time(), time.process_time())
    if groups is None:  # colocated: the same runner and pool, no room, no transfer
        pool = worker.pool
        pages = pool.alloc(pool.pages_needed(len(ids)))
        slot = pool.states.alloc() if pool.states is not None else None  # a hybrid's state
        logits = worker.runner.prefill(pool, ids, pages, slot=slot)
        rec["first_token"] = int(logits.argmax())  # (syncs the device: the token is there)
        rec["t_first_token"] = time.time()
        pool.free(pages)
        if slot is not None:
            pool.states.free(slot)
        return _cpu(rec, cpu0)
    sr = StageRequest(room=room, prompt_ids=ids, sampling=SamplingParams(max_tokens=1))
    res = worker.prefill_one(sr, groups=groups)
    if res.error:
        raise RuntimeError(f"room {room}: {res.error}")
    rec["group_end"] = [g[2] for g in res.timing["groups"]]
    rec["first_token"] = res.first_token
    rec["t_first_token"] = res.timing["computed"]
    return _cpu(rec, cpu0)


def _cpu(rec: dict, cpu0: tuple[float, float]) -> dict:
    compute = time.thread_time() - cpu0[0]
    rec["compute_cpu_ms"] = compute * 1e3
    rec["other_cpu_ms"] = (time.process_time() - cpu0[1] - compute) * 1e3
    return rec


def _prefill_run(state: dict, reqs: list[dict]) -> list[dict]:
    return [_prefill_one(state, r) for r in reqs]


def _prefill_submit(state: dict, reqs: list[dict]) -> dict:
    """Submit every room as serving does (computed once decode registered, batched up to
    ``prefill_batch_tokens``) and answer at once; ``wait`` answers when all are done."""
    from backends.runtime.sampling_params import SamplingParams
    from backends.stages.request import StageRequest

    worker, done, errors = state["worker"], threading.Event(), []
    left = [len(reqs)]

    def on_done(res) -> None:
        if res.error:
            errors.append(res.error)
        left[0] -= 1
        if not left[0]:
            done.set()

    t0, batches0 = time.time(), worker.counters["batches"]
    one = SamplingParams(max_tokens=1)
    for r in reqs:
        worker.submit(StageRequest(room=r["room"], prompt_ids=r["ids"], sampling=one), on_done)
    state["pending"] = (t0, batches0, done, errors)
    return {"t_start": t0}


def _prefill_apply(state: dict, arg: tuple) -> object:
    """``fn(worker, value)`` for ``arg = (fn, value)``, ``fn`` a module-level function (it is
    pickled by name): what a benchmark changes in the stage for one comparison only, e.g.
    benchmarks.hybrid's state held back to the end."""
    fn, value = arg
    return fn(state["worker"], value)


def _prefill_wait(state: dict, _arg=None) -> dict:
    """Wait for the rooms of the last ``submit``: start time, errors, batches computed."""
    t0, batches0, done, errors = state.pop("pending")
    done.wait(900)
    worker = state["worker"]
    return {"t_start": t0, "errors": errors, "batches": worker.counters["batches"] - batches0}


def _prefill_stats(state: dict, rooms: list[int]) -> dict:
    """The sender's per-group records (entry, submitted / done, time.time()) of ``rooms``: one
    per layer group and entry (a hybrid's groups send ``target`` and ``target.state``)."""
    out = {}
    for room in rooms:
        st = state["worker"].room_stats(room)
        if st is not None:
            keys = ("role", "layers", "nbytes", "submitted", "done")
            groups = [{k: g[k] for k in keys} for g in st["groups"]]
            out[room] = {"nbytes": st["nbytes"], "groups": groups}
    return out


# ---- decode ----------------------------------------------------------------------------------
def _decode_make(model, page_size, num_pages, _threads, device, extra) -> dict:
    from backends.stages.decode import DecodeWorker

    worker = DecodeWorker(_params(model, page_size, num_pages, device, extra))
    return {"worker": worker, "info": {"cancel_addr": worker.cancel_addr}}


def _decode_register(state: dict, arg: dict) -> dict:
    """Submit every room at once (streaming, max_tokens=1), wait until all ended; room ->
    result: ``t_first`` when the client got the first token (prefill sends it before the KV
    lands), ``t_done`` when decode ran the room (its KV landed)."""
    from backends.runtime.sampling_params import SamplingParams
    from backends.stages.request import StageRequest

    worker, done, first, cond = state["worker"], {}, {}, threading.Condition()

    def emitter(room: int):
        def emit(ev) -> None:  # heartbeats (no tokens) are not the answer
            with cond:
                if ev.token_ids and room not in first:
                    first[room] = (time.time(), ev.token_ids[0])
                if ev.final:
                    done[room] = (time.time(), ev)
                    cond.notify_all()

        return emit

    for room, ids in arg["rooms"]:
        sr = StageRequest(
            room=room,
            prompt_ids=ids,
            sampling=SamplingParams(max_tokens=1),
            bootstrap_addr=arg["bootstrap_addr"],
            stream=True,
        )
        worker.submit(sr, emitter(room))
    with cond:
        cond.wait_for(lambda: len(done) == len(arg["rooms"]), timeout=arg.get("timeout", 900))
    out = {}
    for room, _ in arg["rooms"]:
        t, ev = done.get(room, (None, None))
        t_first, token = first.get(room, (None, None))
        ok = ev is not None and not ev.error and token is not None
        out[room] = {
            "t_done": t,
            "t_first": t_first,
            "status": "Success" if ok else "Timeout" if ev is None else "Failed",
            "first_token": token if ok else None,
            "reason": "" if ok or ev is None else ev.error,
        }
    return out


# ---- the parent's handle ---------------------------------------------------------------------
class StageError(RuntimeError):
    pass


class Stage:
    """One stage process; ``send`` a command now and ``recv`` its answer later."""

    def __init__(
        self,
        kind: str,
        model: str,
        page_size: int,
        num_pages: int,
        threads: int = 1,
        log_dir: str | None = None,
        device: str = "cpu",
        extra: dict | None = None,  # more stage parameters
    ):
        handlers = {"run": _prefill_run, "stats": _prefill_stats, "submit": _prefill_submit,
                    "wait": _prefill_wait, "apply": _prefill_apply}  # fmt: skip
        make, handlers = {
            "prefill": (_prefill_make, handlers),
            "decode": (_decode_make, {"register": _decode_register}),
        }[kind]
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        init = _Init(make, model, page_size, num_pages, threads, device, extra or {})
        log_path = os.path.join(log_dir, f"stage-{kind}.log") if log_dir else None
        self.proc = ctx.Process(target=_serve, args=(child, init, handlers, log_path), daemon=True)
        self.proc.start()
        self.kind = kind
        self.info = self.recv(timeout=300)

    def send(self, cmd: str, arg=None) -> None:
        self.conn.send((cmd, arg))

    def recv(self, timeout: float = 900):
        if not self.conn.poll(timeout):
            raise StageError(f"{self.kind} stage did not answer in {timeout}s")
        kind, value = self.conn.recv()
        if kind == "err":
            raise StageError(f"{self.kind} stage failed:\n{value}")
        return value

    def call(self, cmd: str, arg=None, timeout: float = 900):
        self.send(cmd, arg)
        return self.recv(timeout)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=20)
            except Exception:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


class _Init:
    """Picklable 'build the stage state' callable for the spawned process."""

    def __init__(self, make, *args):
        self.make, self.args = make, args

    def __call__(self) -> dict:
        return self.make(*self.args)

"""Prefill and decode stages as separate OS processes, for the direct (no Triton) TTFT runs.

Both use the real runtime and kvtransfer, the way the serving stages do:

* prefill: ``ModelRunner`` + ``KVPool`` + ``KVSender``; per request it allocates pages,
  ``start_room`` (claimed when decode's registration arrives), runs the prefill group by group
  with ``send_group`` after each group, samples the first token (greedy) and ``finish``-es the
  room; pages are freed by the release callback. Requests run one after another (one compute
  stream). Colocated mode: the same prefill with no room and no transfer.
* decode: a ``KVPool`` of the same layout + ``KVReceiver``; per request it allocates the
  prompt's pages (+1 generation slot) and registers them, concurrently with prefill. The time a
  room reaches Success (Complete arrives only after every KV write landed) is "decode has the
  first token".

Times are ``time.perf_counter()`` (CLOCK_MONOTONIC, the same clock in every process on Linux).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback

STAGE_CONFIG = dict(host="127.0.0.1", bootstrap_timeout_s=120.0, transfer_timeout_s=600.0)


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
                state["kv"].close()
                conn.send(("ok", None))
                break
            conn.send(("ok", handlers[cmd](state, arg)))
        except Exception:
            conn.send(("err", traceback.format_exc()))


# ---- prefill ---------------------------------------------------------------------------------
def _prefill_make(model: str, page_size: int, num_pages: int, threads: int) -> dict:
    import torch

    from backends.runner import ModelRunner

    torch.set_num_threads(threads)
    from kvtransfer import KVSender, TransferConfig

    runner = ModelRunner.load(model)
    pool = runner.make_pool(num_pages, page_size)
    tx = KVSender(TransferConfig(**STAGE_CONFIG), {"target": pool.layout})
    return {
        "runner": runner,
        "pool": pool,
        "kv": tx,
        "info": {"bootstrap_addr": tx.bootstrap_addr, "num_layers": runner.config.num_layers},
    }


def _prefill_one(state: dict, req: dict) -> dict:
    runner, pool, tx = state["runner"], state["pool"], state["kv"]
    room, ids, groups = req["room"], req["ids"], req["groups"]
    pages = pool.alloc(pool.pages_needed(len(ids)))
    rec: dict = {"room": room, "t_start": time.perf_counter(), "group_end": []}
    # CPU seconds: this (compute) thread vs the whole process (the rest = transfer/control)
    cpu0 = (time.thread_time(), time.process_time())
    if groups is None:  # colocated: no room, no transfer
        logits = runner.prefill(pool, ids, pages)
        rec["first_token"] = int(logits.argmax())
        rec["t_first_token"] = time.perf_counter()
        pool.free(pages)
        return _cpu(rec, cpu0)

    def on_release(_room: int, _status) -> None:
        pool.free(pages)

    tx.start_room(room, {"target": pages}, on_release)

    def on_group(a: int, b: int) -> None:
        rec["group_end"].append(time.perf_counter())
        tx.send_group(room, "target", range(a, b))

    logits = runner.prefill(pool, ids, pages, groups, on_group)
    rec["first_token"] = int(logits.argmax())
    rec["t_first_token"] = time.perf_counter()
    tx.finish(room, rec["first_token"])
    return _cpu(rec, cpu0)


def _cpu(rec: dict, cpu0: tuple[float, float]) -> dict:
    compute = time.thread_time() - cpu0[0]
    rec["compute_cpu_ms"] = compute * 1e3
    rec["other_cpu_ms"] = (time.process_time() - cpu0[1] - compute) * 1e3
    return rec


def _prefill_run(state: dict, reqs: list[dict]) -> list[dict]:
    return [_prefill_one(state, r) for r in reqs]


def _prefill_stats(state: dict, rooms: list[int]) -> dict:
    """Sender's per-group records (submitted/done as perf_counter times) of ``rooms``."""
    shift = time.perf_counter() - time.time()
    out = {}
    for room in rooms:
        st = state["kv"].transfer_stats.get_room(room)
        if st is None:
            continue
        out[room] = {
            "nbytes": st["nbytes"],
            "groups": [
                {
                    "layers": list(g["layers"]),
                    "nbytes": g["nbytes"],
                    "submitted": g["submitted"] + shift,
                    "done": None if g["done"] is None else g["done"] + shift,
                }
                for g in st["groups"]
            ],
        }
    return out


# ---- decode ----------------------------------------------------------------------------------
def _decode_make(model: str, page_size: int, num_pages: int, _threads: int) -> dict:
    from backends.config import ModelConfig
    from backends.runner import ModelRunner
    from kvtransfer import KVReceiver, TransferConfig

    # The decode side only needs the pool here (its forward passes come after the first
    # token): a runner without weights gives the exact pool layout the real decode stage uses.
    runner = ModelRunner(ModelConfig.from_pretrained(model), None, "float32", "cpu")
    pool = runner.make_pool(num_pages, page_size)
    rx = KVReceiver(TransferConfig(**STAGE_CONFIG), {"target": pool.layout})
    return {"pool": pool, "kv": rx, "info": {"session_id": rx.session_id}}


def _decode_register(state: dict, arg: dict) -> dict:
    """Register every room at once, wait until all ended; room -> (t_done, status, token)."""
    pool, rx = state["pool"], state["kv"]
    done: dict[int, tuple[float, str]] = {}
    cond = threading.Condition()
    pages_of: dict[int, list[int]] = {}

    def on_release(room: int, status) -> None:
        t = time.perf_counter()
        pool.free(pages_of[room])  # a real decode stage would keep them for decoding
        with cond:
            done[room] = (t, status.name)
            cond.notify_all()

    for room, n_tokens in arg["rooms"]:
        pages_of[room] = pool.alloc(pool.pages_needed(n_tokens + 1))
        rx.register(room, [arg["bootstrap_addr"]], {"target": pages_of[room]}, n_tokens, on_release)
    with cond:
        cond.wait_for(lambda: len(done) == len(pages_of), timeout=arg.get("timeout", 900))
    out = {}
    for room in pages_of:
        t, status = done.get(room, (None, "Timeout"))
        token = rx.result(room)[0] if status == "Success" else None
        reason = rx.failure_reason(room) if status != "Success" else ""
        out[room] = {"t_done": t, "status": status, "first_token": token, "reason": reason}
        rx.forget(room)
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
    ):
        make, handlers = {
            "prefill": (_prefill_make, {"run": _prefill_run, "stats": _prefill_stats}),
            "decode": (_decode_make, {"register": _decode_register}),
        }[kind]
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        init = _Init(make, model, page_size, num_pages, threads)
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

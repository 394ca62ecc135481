#!/usr/bin/env python
"""Keep every model of a running tritonserver ready: reload a model whose Python stub died.

Triton's Python backend (2.51) does not restart a stub process that crashed or was killed (out
of memory, a fatal signal), and still reports the model ready: every request to it fails with
"Stub process ... is not healthy" until someone loads the model again. serve.sh starts this
watcher next to tritonserver (model control mode ``explicit``, the repository API behind an admin
key). Every ``--interval`` seconds it looks at tritonserver's stub processes (``/proc``: a stub
is named by its model instance) and at each model's ready endpoint; a model with a dead stub, or
not ready on two polls in a row, is loaded again through the repository API with its config's
``reload_generation`` raised, so Triton builds new instances while the old version (its live
instances) serves on, then swaps them. Failed reloads back off
(doubling, at most ``--max-backoff`` seconds). It exits when tritonserver is gone. Standard
library only; one log line per event.

    scripts/supervise.py --url http://127.0.0.1:8000 --pid PID --key-file .run/admin-key-8000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

HEADER = "pd-admin-key"


def log(msg: str) -> None:
    print(f"[supervise] {time.strftime('%H:%M:%S')} {msg}", flush=True)


class Triton:
    def __init__(self, url: str, key: str, timeout: float):
        self.url, self.key, self.timeout = url.rstrip("/"), key, timeout

    def _req(
        self, method: str, path: str, timeout: float | None = None, data: bytes = b""
    ) -> tuple[int, bytes]:
        req = urllib.request.Request(
            self.url + path, method=method, data=data if method == "POST" else None
        )
        req.add_header(HEADER, self.key)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def models(self) -> list[Model]:
        """Every model in the repository index."""
        code, body = self._req("POST", "/v2/repository/index")
        if code != 200:
            raise OSError(f"repository index: HTTP {code} {body[:200]!r}")
        return [self._model(entry["name"]) for entry in json.loads(body)]

    def _model(self, name: str) -> Model:
        code, body = self._req("GET", f"/v2/models/{name}/config")
        if code != 200:
            raise OSError(f"config of {name}: HTTP {code} {body[:200]!r}")
        cfg = json.loads(body)
        if cfg.get("platform") == "ensemble":
            return Model(name, True, None)
        count = 0
        for group in cfg.get("instance_group", []):
            gpus = group.get("gpus") or []
            if group.get("kind") == "KIND_GPU" and not gpus:
                return Model(name, False, None)  # one per visible GPU: not known from here
            count += int(group.get("count", 1)) * max(1, len(gpus))
        return Model(name, False, count or None)

    def ready(self, name: str) -> bool:
        return self._req("GET", f"/v2/models/{name}/ready")[0] == 200

    def reload(self, name: str, generation: int, timeout: float) -> str:
        """Load ``name`` again with its config's ``reload_generation`` parameter raised: a
        changed config makes Triton build new instances while the old version serves on (a
        plain load keeps instances whose files did not change). '' when it loaded, else why
        not."""
        code, body = self._req("GET", f"/v2/models/{name}/config")
        if code != 200:  # not loaded at all: load it from the repository
            body, cfg = b"", None
        else:
            cfg = json.loads(body)
            cfg.setdefault("parameters", {})["reload_generation"] = {
                "string_value": str(generation)
            }
            body = json.dumps({"parameters": {"config": json.dumps(cfg)}}).encode()
        code, out = self._req("POST", f"/v2/repository/models/{name}/load", timeout, body)
        return "" if code == 200 else f"HTTP {code}: {out[:300].decode(errors='replace')}"


STUB = b"triton_python_backend_stub"


@dataclass
class Model:
    name: str
    ensemble: bool
    instances: int | None  # stub processes it runs, when the config says


def stubs(server_pid: int) -> dict[int, str | None]:
    """pid -> model of each Python-backend stub of ``server_pid``; None for a dead stub (a zombie
    its server did not reap: it has no command line any more)."""
    out: dict[int, str | None] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if int(ppid) != server_pid:
            continue
        if state in "ZX":
            out[int(d)] = None
        elif len(args) > 1 and args[0].endswith(STUB):
            out[int(d)] = os.path.basename(os.path.dirname(os.path.dirname(args[1].decode())))
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Supervisor:
    def __init__(self, triton: Triton, pid: int, retire_dir: str, args: argparse.Namespace):
        self.triton, self.pid, self.retire_dir = triton, pid, retire_dir
        self.only: set[str] = set(filter(None, getattr(args, "models", "").split(",")))
        self.interval, self.max_backoff, self.load_s = (
            args.interval,
            args.max_backoff,
            args.load_timeout,
        )
        self.names: dict[int, str] = {}  # pid -> model of every stub seen alive
        self.zombie: dict[int, int] = {}  # pid -> polls it was seen dead
        self.short: dict[str, int] = {}  # model -> polls it ran fewer stubs than configured
        self.retired: set[int] = set()  # stubs of replaced versions (they exit when idle)
        self.broken: set[str] = set()  # models to reload
        self.misses: dict[str, int] = {}
        self.next_try: dict[str, float] = {}
        self.backoff: dict[str, float] = {}
        self.reloads = 0

    def _deaths(self, models: list[Model]) -> None:
        """A model misses a stub process when fewer of its stubs are alive than its config
        runs, or one of its stubs is dead (a zombie) on two polls in a row. A stub that exits
        because its version was unloaded is reaped by tritonserver at once."""
        now = stubs(self.pid)
        for pid, name in now.items():
            if name is not None:
                self.names[pid] = name
            elif pid in self.names and pid not in self.retired:
                self.zombie[pid] = self.zombie.get(pid, 0) + 1
                if self.zombie[pid] == 2:
                    log(f"stub process {pid} of model {self.names[pid]} died")
                    self.broken.add(self.names[pid])
        for m in models:
            live = sum(1 for pid, name in now.items() if name == m.name and pid not in self.retired)
            short = m.instances is not None and live < m.instances and m.name not in self.broken
            self.short[m.name] = self.short.get(m.name, 0) + 1 if short else 0
            if self.short[m.name] == 2:
                log(f"model {m.name} runs {live} of its {m.instances} stub processes")
                self.broken.add(m.name)
        for pid in [p for p in self.names if p not in now]:  # reaped: forget it
            self.names.pop(pid)
            self.zombie.pop(pid, None)
            self.retired.discard(pid)
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.retire_dir, str(pid)))

    def poll(self, models: list[Model]) -> None:
        """One round: a model missing a stub, or not ready twice in a row, is reloaded
        (composing models first, then ensembles) until a reload works."""
        self._deaths(models)
        for name in [m.name for m in sorted(models, key=lambda m: m.ensemble)]:
            if name not in self.broken:
                if self.triton.ready(name):
                    self.misses[name] = 0
                    continue
                self.misses[name] = self.misses.get(name, 0) + 1
                if self.misses[name] < 2:
                    continue
                log(f"model {name} is not ready")
                self.broken.add(name)
            if time.monotonic() >= self.next_try.get(name, 0.0):
                self._reload(name)

    def _reload(self, name: str) -> None:
        old = [pid for pid, m in stubs(self.pid).items() if m == name]
        t0 = time.monotonic()
        why = self.triton.reload(name, self.reloads + 1, self.load_s)
        if why:
            wait = min(self.max_backoff, 2 * self.backoff.get(name, self.interval))
            self.backoff[name], self.next_try[name] = wait, time.monotonic() + wait
            log(f"reloading {name} failed ({why}); next try in {wait:.0f}s")
            return
        self.reloads += 1
        took = time.monotonic() - t0
        log(f"model {name} reloaded in {took:.1f}s (reloads so far: {self.reloads})")
        self.broken.discard(name)
        self.misses[name], self.backoff[name] = 0, self.interval
        self._retire(old)

    def _retire(self, pids: list[int]) -> None:
        """The replaced version's live stubs: Triton never unloads a version whose dead stub
        held requests, so they are asked to finish their work and exit (a file named by pid)."""
        for pid in pids:
            self.retired.add(pid)
            with contextlib.suppress(OSError), open(os.path.join(self.retire_dir, str(pid)), "w"):
                pass
        if pids:
            log(f"asked the replaced stub processes {pids} to exit once idle")

    def run(self) -> int:
        models: list[Model] = []
        while alive(self.pid):
            try:
                models = models or [
                    m for m in self.triton.models() if not self.only or m.name in self.only
                ]
                self.poll(models)
            except (OSError, ValueError) as e:  # the server is starting or stopping
                log(f"poll failed: {e}")
            time.sleep(self.interval)
        log(f"tritonserver (pid {self.pid}) is gone; exiting")
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="Triton's HTTP endpoint")
    ap.add_argument("--pid", type=int, required=True, help="exit when this process is gone")
    ap.add_argument("--key-file", required=True, help=f"holds the '{HEADER}' header's value")
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--max-backoff", type=float, default=60.0)
    ap.add_argument("--load-timeout", type=float, default=600.0)
    ap.add_argument(
        "--models", default="", help="comma-separated models to watch (default: every one)"
    )
    ap.add_argument(
        "--retire-dir", required=True, help="where replaced stubs look for their exit request"
    )
    args = ap.parse_args(argv)
    with open(args.key_file) as f:
        key = f.read().strip()
    triton = Triton(args.url, key, timeout=10.0)
    log(f"watching {args.url} (tritonserver pid {args.pid}) every {args.interval:g}s")
    os.makedirs(args.retire_dir, exist_ok=True)
    sup = Supervisor(triton, args.pid, args.retire_dir, args)
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())

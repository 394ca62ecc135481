"""Tensor parallelism through the real Triton ensemble, on SmolLM2 (3 KV heads): prefill over 3
ranks (with speculative decoding, its draft over 3 ranks too) and decode over 1, and the reverse.
Greedy output equals transformers token for token, streaming and not, and every page comes back
on both stages. A prefill worker rank killed
(SIGKILL) makes requests fail with an error (never hang) until the stage, whose process exits
on its own, is loaded again by serve.sh's supervisor with new ranks; then it serves the same
tokens, and the killed rank's stage process and workers are gone."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import proc_net
import pytest
from triton_harness import MODEL, assert_greedy, launch, stop, until_served, wait_pages_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

N = 12
# kv_checksum does not cover TP ranks yet (refused at the handshake): off for these servers
BASE = ["num_pages=64", "max_context=512", "max_tokens_limit=64", "kv_checksum=false"]
PROMPTS = [("What is the capital of France?", True), ("The tallest mountain is", False)]


def stage_procs(pgid: int, stage: str) -> tuple[int, list[int]]:
    """(the stage's stub process, its TP worker processes)."""
    p = proc_net.stage_stub(pgid, stage)
    assert p is not None, f"no {stage} stub process"
    return p, [c for c in proc_net.tree(p) if c != p and _is_worker(c)]


def _is_worker(pid: int) -> bool:
    return b"spawn_main" in proc_net.cmdline(pid)  # not the resource tracker


def _running(pid: int) -> bool:
    return not _describe(pid).split(" ", 1)[1].startswith(("gone", "State:\tZ"))


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(x for x in f if x.startswith("State"))
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid} {state.strip()} {f.read()[:120]!r}"
    except OSError:
        return f"{pid} gone"


def check_greedy(srv, reference) -> None:
    assert_greedy(srv, reference, PROMPTS, N)
    used = wait_pages_free(srv)
    assert used[("pd_kv_pages_in_use", "prefill")] == 0
    assert used[("pd_kv_pages_in_use", "decode")] == 0


def truncated_draft(tmp_path, layers: int) -> str:
    """SmolLM2's first ``layers`` layers as a checkpoint of its own (a draft that is not the
    target's layers: on tensor-parallel stages it runs on ranks of its own)."""
    src, out = Path(MODEL), tmp_path / "draft"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return str(out)


def test_prefill_tp3_decode_tp1_equals_transformers_and_survives_a_killed_rank(tmp_path, reference):
    """With speculative decoding on: the draft (its own checkpoint) on 3 prefill ranks of its
    own, each sending its draft KV head to decode's one rank; output still the target's."""
    spec = ["spec_enabled=true", f"draft_model_dir={truncated_draft(tmp_path, 8)}",
            "decode.spec_tokens=2"]  # fmt: skip
    srv, serve, env = launch(tmp_path, [*BASE, "prefill.tensor_parallel_size=3", *spec])
    try:
        check_greedy(srv, reference)
        stub, workers = stage_procs(srv.pid, "prefill")
        assert len(workers) == 4  # ranks 1 and 2 of the target and of the draft
        os.kill(workers[0], signal.SIGKILL)
        fields = {"text_input": PROMPTS[1][0], "max_tokens": N}
        out = until_served(srv, fields)  # errors meanwhile (rank dead, reloading), no hang
        assert out.get("output_ids") == reference.greedy(PROMPTS[1][0], False, N), out
        new_stub, new_workers = stage_procs(srv.pid, "prefill")
        assert new_stub != stub and len(new_workers) == 4
        gone, end = [stub, *workers], time.time() + 15
        while [p for p in gone if _running(p)] and time.time() < end:
            time.sleep(0.5)
        # no orphan: every old process exited (the old stub may wait as a zombie until
        # tritonserver reaps it; it holds no memory)
        assert not [p for p in gone if _running(p)], [_describe(p) for p in gone]
        with open(srv.log, errors="replace") as f:
            log = f.read()
        assert re.search(r"tensor-parallel rank \d died \(exit code -9\)", log)
        assert "model prefill reloaded" in log
    finally:
        stop(srv, serve, env, timeout_s=5)  # a dead version lingers


def test_prefill_tp1_decode_tp3_equals_transformers(tmp_path, reference):
    srv, serve, env = launch(tmp_path, [*BASE, "decode.tensor_parallel_size=3"])
    try:
        check_greedy(srv, reference)
        assert len(stage_procs(srv.pid, "decode")[1]) == 2
    finally:
        stop(srv, serve, env)

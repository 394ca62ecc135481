"""A hybrid model's state crosses from prefill to decode (stage cores, PrefillWorker in its own
process, real Mooncake): each recurrent layer's final state goes with its layer group as entry
``target.state`` (the room's slot), the attention layers' pages as ``target``, a sliding-window
family's sliding layers as ``target.window`` (only the pages the prompt's last window reaches).
Greedy output equals transformers' for prompts spanning several layer groups (one layer a group)
and pages; pages and slots all come back, a cancel included. A prefill that leaves the state
entry behind gives other tokens (the state is not optional), and a decode whose state layout
differs is refused at the handshake, naming the entry."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from runtime_models import checkpoint, hf_greedy, random_prompt
from stagepeer import Collector, PrefillProcess, tiny_params

from backends.runtime.sampling_params import SamplingParams
from backends.stages.decode import DecodeWorker
from backends.stages.params import StageParams
from backends.stages.request import StageRequest
from kvtransfer import EntryLayout, KVReceiver, KVSender, TransferConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
NEW = 10


def request(room: int, ids: list[int], addr: str, max_tokens: int = NEW) -> StageRequest:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return StageRequest(room=room, prompt_ids=ids, sampling=sp, bootstrap_addr=addr, stream=True)


def run_rooms(prefill, decode, prompts: dict[int, list[int]]) -> dict[int, Collector]:
    outs = {}
    for room, ids in prompts.items():  # decode registers first, as in the ensemble
        outs[room] = Collector()
        decode.submit(request(room, ids, prefill.addr), outs[room])
    results, _ = prefill.submit_all(list(prompts.items()))
    assert [err for _, err in results] == [None] * len(prompts)
    for c in outs.values():
        assert c.done.wait(120)
    return outs


def all_back(prefill, decode) -> bool:
    deadline = time.time() + 15
    while time.time() < deadline and (decode.pages_in_use or prefill.pages_in_use()):
        time.sleep(0.1)
    return decode.pages_in_use == 0 and prefill.pages_in_use() == 0


ENTRIES = {
    "qwen3_next": {"target", "target.state"},
    "nemotron_h": {"target", "target.state"},
    "gemma3": {"target", "target.window"},
    "gpt_oss": {"target", "target.window"},
}


@pytest.mark.parametrize("kind", list(ENTRIES))
def test_the_state_crosses_with_its_layer_groups_and_decode_equals_transformers(kind):
    ckpt = checkpoint(kind)
    prefill = PrefillProcess(**tiny_params(ckpt))
    decode = DecodeWorker(StageParams(**tiny_params(ckpt)))
    try:
        assert set(decode.pools) == ENTRIES[kind]
        prompts = {300 + n: random_prompt(n, seed=n) for n in (3, 29, 70)}
        outs = run_rooms(prefill, decode, prompts)
        for room, ids in prompts.items():
            assert outs[room].events[-1].error is None
            assert outs[room].ids == hf_greedy(kind, ids, NEW)
        stats = prefill.stats()
        assert stats["bytes"] > 0 and stats["rooms_ok"] == len(prompts)
        # a client that cancels after its first tokens: its pages and slot come back too
        flag = threading.Event()
        c = Collector()
        decode.submit(request(400, prompts[329], prefill.addr, 100), c, flag.is_set)
        prefill.submit_all([(400, prompts[329])])
        deadline = time.time() + 60
        while len(c.ids) < 2 and time.time() < deadline:
            time.sleep(0.01)
        flag.set()
        assert c.done.wait(60) and c.events[-1].finish_reason == "cancelled"
        assert all_back(prefill, decode)
    finally:
        decode.close()
        prefill.stop()


def test_a_prefill_that_leaves_the_state_behind_gives_other_tokens():
    """Decode would run every recurrent layer from a zero state and still answer fluently
    (ATOM #2154): the state entry is part of the room, and dropping it changes the output."""
    kind = "qwen3_next"
    ckpt = checkpoint(kind)
    prefill = PrefillProcess(skip_role="target.state", **tiny_params(ckpt))
    decode = DecodeWorker(StageParams(**tiny_params(ckpt, transfer_timeout_s=20.0)))
    try:
        ids = random_prompt(40, seed=3)
        outs = run_rooms(prefill, decode, {500: ids})
        assert outs[500].ids != hf_greedy(kind, ids, NEW)
    finally:
        decode.close()
        prefill.stop()


def state_layout(segments, buf) -> EntryLayout:
    elems = sum(h * e for h, e in segments)
    lay = EntryLayout(role="target.state", attn="state", dtype="float32", page_size=1,
                      num_layers=2, num_pages=4, head_dim=elems, segments=segments)  # fmt: skip
    return lay.with_pool(4, buf.ctypes.data)


def test_a_decode_whose_state_layout_differs_is_refused_naming_the_entry():
    kv = EntryLayout(role="target", attn="gqa", dtype="float32", page_size=4, num_layers=2,
                     num_pages=8, kv_heads=1, head_dim=8)  # fmt: skip
    bufs = [np.zeros(kv.nbytes, np.uint8) for _ in range(2)] + [
        np.zeros(4096, np.uint8) for _ in range(2)
    ]
    tx_layouts = {
        "target": kv.with_pool(8, bufs[0].ctypes.data),
        "target.state": state_layout([(2, 6), (2, 8)], bufs[2]),
    }
    rx_layouts = {  # the same slot bytes, other heads: a state layout mismatch only
        "target": kv.with_pool(8, bufs[1].ctypes.data),
        "target.state": state_layout([(4, 3), (2, 8)], bufs[3]),
    }
    cfg = TransferConfig(host="127.0.0.1", bootstrap_timeout_s=10.0)
    tx, rx = KVSender(cfg, tx_layouts), KVReceiver(cfg, rx_layouts)
    try:
        rx.register(
            9, [tx.bootstrap_addr], {"target": [0, 1], "target.state": [2]}, 6, lambda r, s: None
        )
        tx.start_room(9, {"target": [3, 4], "target.state": [1]})
        assert rx.wait(9, 20).name == "Failed"
        why = rx.failure_reason(9)
        assert "target.state" in why and "segments differs" in why
    finally:
        tx.close()
        rx.close()


def colocated_greedy(ckpt: str, dtype: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The same runtime, colocated (itself checked against transformers in tests/unit)."""
    from backends.runtime.engine import LLMEngine
    from backends.runtime.loader import load_runner

    runner = load_runner(ckpt, dtype=dtype)
    engine = LLMEngine(runner, runner.make_pool(128, 4, num_slots=8))
    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    return [s.output_ids for s in engine.generate([(p, sp) for p in prompts])]


@pytest.mark.parametrize("kind", ["qwen3_next", "nemotron_h", "gemma3"])
def test_bfloat16_pd_equals_bfloat16_colocated(kind):
    ckpt = checkpoint(kind)
    params = tiny_params(ckpt, dtype="bfloat16")
    prefill, decode = PrefillProcess(**params), DecodeWorker(StageParams(**params))
    try:
        prompts = {600 + n: random_prompt(n, seed=n) for n in (11, 47)}
        outs = run_rooms(prefill, decode, prompts)
        want = colocated_greedy(ckpt, "bfloat16", list(prompts.values()), NEW)
        assert [outs[r].ids for r in prompts] == want
        assert all_back(prefill, decode)
    finally:
        decode.close()
        prefill.stop()


@pytest.mark.parametrize("role", ["target.state", "target"])
def test_a_failed_state_or_kv_transfer_fails_the_request_and_gives_back_pages_and_slots(role):
    ckpt = checkpoint("qwen3_next")
    params = tiny_params(ckpt, transfer_timeout_s=20.0)
    prefill = PrefillProcess(fail_role=role, **params)
    decode = DecodeWorker(StageParams(**params))
    try:
        c = Collector()
        ids = random_prompt(30, seed=4)
        decode.submit(request(700, ids, prefill.addr), c)
        prefill.submit_all([(700, ids)])
        assert c.done.wait(60) and c.events[-1].error
        assert all_back(prefill, decode)
        assert decode.pools["target.state"].pages_in_use == 0
    finally:
        decode.close()
        prefill.stop()

"""benchmarks.hybrid: the flagship byte counts, the held-back state sender of the comparison, the
summaries, and the quick run's JSON (bytes and speed parts; the exposed part, which runs stage
processes over Mooncake, is tests/integration/test_bench_hybrid_smoke.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from benchmarks.hybrid import exposed, run, shapes


@pytest.fixture(scope="module")
def flagships() -> dict:
    out = shapes.measure((1024, 8192))
    return {
        "families": {f["family"]: f for f in out["families"]},
        "rows": {(r["family"], r["tokens"]): r for r in out["rows"]},
    }


def test_qwen3_next_moves_its_attention_pages_and_one_state_slot_a_layer(flagships):
    fam = flagships["families"]["qwen3-next-80b-a3b"]
    assert fam["layer_kinds"] == {"full_attention": 12, "linear_attention": 36}
    # a DeltaNet layer: conv q, k (16 x 128), v (32 x 128) over 3 steps + 32 x 128 x 128, float32
    slot = ((16 * 128 * 2 + 32 * 128) * 3 + 32 * 128 * 128) * 4
    assert fam["state_slot_bytes"] == slot and fam["state_bytes_per_request"] == 36 * slot
    assert fam["state_entry_matches_spec"]
    row = flagships["rows"]["qwen3-next-80b-a3b", 1024]
    kv = 12 * 2 * 2 * 256 * 2  # 12 attention layers, K and V, 2 heads x 256, bfloat16
    assert row["entry_bytes"] == {"target": kv * 1024, "target.state": 36 * slot}
    assert row["full_attention_bytes_per_token"] == 48 * 2 * 2 * 256 * 2
    assert row["ratio_to_full_attention"] == pytest.approx(
        (kv * 1024 + 36 * slot) / (4 * kv * 1024)
    )


def test_sliding_layers_move_only_the_window_pages(flagships):
    gemma = flagships["rows"]["gemma-3-4b", 8192]
    win = 29 * 2 * 4 * 256 * 2 * 16  # a page of the 29 sliding layers, bfloat16
    assert gemma["entry_bytes"]["target.window"] == 1024 // 16 * win  # the last 1,024 tokens
    assert gemma["window_saved_fraction"] == pytest.approx(1 - 1024 / 8192)
    assert flagships["rows"]["gemma-3-4b", 1024]["window_saved_fraction"] == 0  # all in window
    oss = flagships["rows"]["gpt-oss-20b", 1024]
    assert oss["entry_bytes"]["target.window"] == 8 * 12 * 2 * 8 * 64 * 2 * 16  # 128 tokens
    assert oss["entry_bytes"]["target"] == 1024 * 12 * 2 * 8 * 64 * 2
    assert "target.state" not in oss["entry_bytes"]


def test_nemotron_h_mlp_layers_hold_nothing_in_either_model(flagships):
    fam = flagships["families"]["nemotron-nano-9b-v2"]
    assert fam["layer_kinds"] == {"full_attention": 4, "mamba": 27, "mlp": 25}
    row = flagships["rows"]["nemotron-nano-9b-v2", 8192]
    assert row["full_attention_bytes_per_token"] == 31 * 2 * 8 * 128 * 2  # 31 mixers, not 56
    assert row["entry_bytes"]["target"] == 8192 * 4 * 2 * 8 * 128 * 2


class FakeSender:
    def __init__(self):
        self.calls = []

    def send_group(self, room, role, layers, fence=None):
        self.calls.append(("send_group", room, role, layers, fence))

    def first_token(self, room, token):
        self.calls.append(("first_token", room, token))

    def is_live(self, room):
        return True


def test_hold_state_sends_every_state_layer_once_just_before_the_first_token():
    inner = FakeSender()
    held = exposed.HoldState(inner)
    held.send_group(7, "target", range(0, 1), "f0")
    held.send_group(7, exposed.STATE, range(0, 3), "f0")
    held.send_group(7, "target", range(1, 2), "f1")
    held.send_group(7, exposed.STATE, range(3, 5), "f1")
    assert [c[2] for c in inner.calls] == ["target", "target"]  # the state waits
    assert held.is_live(7)  # anything else goes straight through
    held.first_token(7, 42)
    assert inner.calls[2:] == [
        ("send_group", 7, exposed.STATE, range(0, 5), "f1"),  # the last group's fence
        ("first_token", 7, 42),
    ]
    with pytest.raises(ValueError, match="after"):  # a gap would lose a layer's state
        held.send_group(8, exposed.STATE, range(2, 3))


@dataclass(frozen=True)
class Batch:
    sender: object


def test_hold_state_wraps_and_unwraps_the_stage_sender():
    sender = FakeSender()
    worker = type("W", (), {})()
    worker.batch = Batch(sender)
    assert exposed.hold_state(worker, True) and isinstance(worker.batch.sender, exposed.HoldState)
    exposed.hold_state(worker, True)  # never wrapped twice
    assert worker.batch.sender.inner is sender
    exposed.hold_state(worker, False)
    assert worker.batch.sender is sender


def test_state_plan_and_check():
    cfg = shapes.model_config(shapes.SHAPES[0])  # Qwen3-Next: DeltaNet x 3, attention, ...
    groups = [(0, 4), (4, 6), (6, 48)]
    plan = exposed.state_plan(cfg, groups, "with-group")
    assert plan == [(0, range(0, 3)), (1, range(3, 5)), (2, range(5, 36))]
    assert exposed.state_plan(cfg, groups, "at-end") == [(2, range(0, 36))]
    ends = [10.0, 20.0, 30.0]
    stats = [{"layers": [r.start, r.stop], "submitted": ends[k] + 0.1} for k, r in plan]
    assert exposed.state_as_planned(plan, stats, ends)
    lagging = [dict(s) for s in stats]
    lagging[0]["submitted"] = 20.05  # queued just after the next group ended: still in plan
    assert exposed.state_as_planned(plan, lagging, ends)
    early = [dict(s) for s in stats]
    early[1]["submitted"] = 15.0  # group 1's state queued before group 1 was computed
    assert not exposed.state_as_planned(plan, early, ends)
    swapped = [dict(s) for s in stats]
    swapped[0]["submitted"] = 29.0  # queued after group 1's state: out of order
    assert not exposed.state_as_planned(plan, swapped, ends)
    assert not exposed.state_as_planned(plan, stats[:2], ends)  # a state group missing


def _sample(mode, run, exposed_ms, ttft):
    s = {"model": "m", "prompt_len": 64, "mode": mode, "run": run, "ttft_ms": ttft,
         "compute_ms": 1.0, "tokens_match": True}  # fmt: skip
    if mode != "colocated":
        s.update(exposed_ms=exposed_ms, bytes={"target": 100, exposed.STATE: 40},
                 state_groups=2 if mode == "with-group" else 1, state_as_planned=True)  # fmt: skip
    return s


def test_summaries_medians_p99_and_paired_saving():
    samples = [_sample("colocated", r, None, 5.0) for r in range(3)]
    samples += [_sample("with-group", r, 10.0 + r, 20.0) for r in range(3)]
    samples += [_sample("at-end", r, 30.0 + 2 * r, 40.0) for r in range(3)]
    rows = exposed.summarize(samples, p99_min=3)
    assert [r["mode"] for r in rows] == list(exposed.MODES)
    assert rows[1]["exposed_median_ms"] == 11.0 and rows[1]["exposed_p99_ms"] == 12.0
    assert exposed.summarize(samples, p99_min=4)[1]["exposed_p99_ms"] is None
    (cmp,) = exposed.compare(rows, samples)
    assert cmp["exposed_saved_ms"] == 32.0 - 11.0
    assert cmp["exposed_saved_paired_median_ms"] == 21.0  # runs: 20, 21, 22
    assert (cmp["state_bytes"], cmp["kv_bytes"], cmp["ttft_colocated_ms"]) == (40, 100, 5.0)
    assert exposed.nearest_rank(list(range(1, 201)), 0.99) == 198


def test_quick_json_keys(capsys, tmp_path):
    argv = ["--quick", "--parts", "bytes", "speed", "--json", "--model-dir", str(tmp_path)]
    assert run.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"meta", "bytes", "speed"}
    for key in ("date", "cpus", "torch_threads", "load_avg_start", "load_avg_end", "command"):
        assert key in out["meta"]
    assert {f["family"] for f in out["bytes"]["families"]} == {s.name for s in shapes.SHAPES}
    for r in out["bytes"]["rows"]:
        assert r["bytes_per_token"] > 0 and r["ratio_to_full_attention"] > 0
        assert ("window_saved_fraction" in r) == ("target.window" in r["entry_bytes"])
    assert set(out["speed"]) == set(run.QUICK["models"])
    for res in out["speed"].values():
        assert set(res["ratio"]) == {"prefill_64_tok_s", "decode_b2_tok_s"}
        assert all(v > 0 for v in res["results"]["transformers"].values())
    (tmp_path / "r.json").write_text(json.dumps(out))  # the tables again, from the JSON
    assert run.main(["--from-json", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "| qwen3-next-80b-a3b | 12 full_attention, 36 linear_attention | 75.4 MiB |" in text
    assert text.count("| qwen3-next-tiny |") == 2  # prefill and decode rows


def test_quick_parses_and_refuses():
    args = run.parse_args(["--quick"])
    assert args.runs == 1 and args.models == list(run.QUICK["models"])
    with pytest.raises(SystemExit):
        run.parse_args(["--runs", "0"])

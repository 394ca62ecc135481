"""benchmarks.prefix's pure parts: the reuse it credits a workload with, the counters it reads
from a metrics endpoint, and its verdicts on issue 47's targets."""

from __future__ import annotations

from benchmarks.prefix.counters import counters_of, delta
from benchmarks.prefix.report import headline
from benchmarks.prefix.workload import Chat, Reply, chats, messages, reuse


def rec(prompt, out=()):
    return {"prompt": list(prompt), "reply": Reply(0.0, ids=list(out))}


def test_reuse_is_the_longest_prefix_an_earlier_prompt_or_answer_carried():
    records = [
        rec([1, 2, 3, 4], out=[5, 6]),
        rec([1, 2, 3, 4, 5, 6, 7]),  # the previous turn's prompt and answer: 6 seen
        rec([1, 2, 9]),  # a shared prefix of 2
        rec([8, 1, 2]),  # nothing seen from its start
    ]
    assert reuse(records) == [0, 6, 2, 0]


def test_a_turn_s_chat_carries_the_earlier_turns_and_their_answers():
    chat = Chat(0, ["q1", "q2", "q3"], answers=["a1", "a2"])
    msgs = messages("sys", chat, 2)
    assert [m["content"] for m in msgs] == ["sys", "q1", "a1", "q2", "a2", "q3"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert all(4 <= len(c.users) <= 8 for c in chats(20, (4, 8), seed=1))
    assert chats(3, (4, 8), seed=1)[2].users == chats(3, (4, 8), seed=1)[2].users  # seeded


def test_counters_sum_instances_of_a_stage_and_keep_stages_apart():
    samples = [
        ("pd_kv_transfer_bytes_total", {"stage": "prefill", "instance": "a"}, 100.0),
        ("pd_kv_transfer_bytes_total", {"stage": "prefill", "instance": "b"}, 50.0),
        ("pd_kv_transfer_bytes_total", {"stage": "decode", "instance": "d"}, 999.0),
        ("pd_prefix_cached_tokens_total", {"stage": "decode"}, 7.0),
        ("pd_router_requests_total", {"stage": "router", "server": "s1"}, 3.0),
    ]
    got = counters_of(samples)
    assert got["prefill_bytes"] == 150 and got["decode_cached"] == 7 and got["prefill_cached"] == 0
    assert got["routed"] == {"s1": 3}
    later = counters_of([*samples, ("pd_router_requests_total", {"server": "s2"}, 2.0)])
    assert delta(later, got)["routed"] == {"s1": 0, "s2": 2}


def mode(ttft, hit_prefill, hit_decode, bytes_per_token, reuse_fraction=0.9):
    return {
        "ttft_p50_s": ttft,
        "prefill_hit_rate": hit_prefill,
        "decode_hit_rate": hit_decode,
        "kv_bytes_per_prompt_token": bytes_per_token,
        "reuse_fraction": reuse_fraction,
        "records": [],
    }


def test_headline_ratios_and_verdicts():
    res = {
        "pd-cache": mode(1.0, 0.8, 0.75, 30.0),
        "pd-queue": mode(1.2, 0.5, 0.75, 30.0),
        "pd-off": mode(5.0, 0.0, 0.0, 100.0),
    }
    h = headline(res)
    assert h["ttft_p50_cached_over_uncached"] == 0.2
    assert abs(h["bytes_over_uncached_share"] - 0.3 / 0.25) < 1e-9  # 1.2: 20 % over
    assert abs(h["prefill_hit_rate_cache_aware_over_least_queue"] - 1.6) < 1e-9
    met = {k: t["met"] for k, t in h["targets"].items()}
    assert met == {
        "ttft_p50_cached_over_uncached": True,
        "bytes_over_uncached_share": False,
        "prefill_hit_rate_cache_aware_over_least_queue": False,
    }
    res["pd-cache"]["reuse_fraction"] = 0.5  # the TTFT target holds only at >= 80 % reuse
    assert not headline(res)["targets"]["ttft_p50_cached_over_uncached"]["met"]
    assert headline({})["targets"]["bytes_over_uncached_share"]["met"] is None  # not run

"""benchmarks.ttft: the pure logic (groups per mode, exposed fraction, summary, arguments)."""

from __future__ import annotations

import json

import pytest

from backends.stages.policy import LayerGroupPolicy
from benchmarks.ttft import analysis as an
from benchmarks.ttft import run as bench_ttft
from benchmarks.ttft.report import markdown_table


def test_exposed_fraction_math():
    assert an.exposed_fraction(150.0, 100.0, 200.0) == pytest.approx(0.5)
    assert an.exposed_fraction(100.0, 100.0, 200.0) == 0.0  # fully hidden
    assert an.exposed_fraction(200.0, 100.0, 200.0) == 1.0  # as bad as serial
    assert an.exposed_fraction(90.0, 100.0, 300.0) == pytest.approx(-0.05)  # noise below floor
    assert an.exposed_fraction(120.0, 100.0, 100.0) is None  # serial not slower: undefined
    assert an.exposed_fraction(120.0, 100.0, 90.0) is None


@pytest.mark.parametrize("layers,k,want", [(30, 4, 4), (30, 8, 8), (12, 8, 8), (30, None, 30)])
def test_even_groups_tile_the_layers(layers, k, want):
    g = an.even_groups(layers, k)
    assert len(g) == want
    assert g[0][0] == 0 and g[-1][1] == layers
    assert all(a < b for a, b in g) and all(g[i][1] == g[i + 1][0] for i in range(len(g) - 1))
    sizes = [b - a for a, b in g]
    assert max(sizes) - min(sizes) <= 1


def test_even_groups_clamps_to_layer_count():
    assert an.even_groups(3, 8) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError):
        an.even_groups(0, 2)


def test_mode_groups():
    assert an.mode_groups("colocated", 4096, 30) is None
    assert an.mode_groups("serial", 4096, 30) == [(0, 30)]
    assert an.mode_groups("pipelined", 4096, 30) == LayerGroupPolicy().groups(4096, 30)
    assert an.mode_groups("pipelined", 128, 30) == [(0, 30)]  # under min_tokens: one group
    assert len(an.mode_groups("fixed-all", 4096, 30)) == 30
    with pytest.raises(ValueError, match="unknown mode"):
        an.mode_groups("bogus", 10, 30)


def _fake_samples() -> list[dict]:
    """3 runs: colocated 100 ms, serial 200 ms, pipelined 130 ms (4 groups) at 4096 tokens;
    short prompt (128): serial 20, pipelined 21, colocated 18."""
    out = []
    ttft = {
        (4096, "colocated"): (100, 0),
        (4096, "serial"): (200, 1),
        (4096, "pipelined"): (130, 4),
        (128, "colocated"): (18, 0),
        (128, "serial"): (20, 1),
        (128, "pipelined"): (21, 1),
    }
    for run in range(3):
        for (n, mode), (t, g) in ttft.items():
            s = dict(model="m", prompt_len=n, concurrency=1, mode=mode, groups=g, run=run)
            s.update(ttft_ms=t + run, compute_ms=t * 0.9 if mode == "colocated" else 90.0)
            if mode != "colocated":
                s.update(tail_ms=t - 90.0, wire_gbps=1.0)
            # the client's first token: before the KV landed in transfer modes
            s["first_token_ms"] = t + run if mode == "colocated" else 92.0 + run
            out.append(s)
    return out


def test_rows_and_headline_json_keys():
    rows = an.build_rows(_fake_samples())
    assert len(rows) == 6
    pip = next(r for r in rows if r["prompt_len"] == 4096 and r["mode"] == "pipelined")
    assert pip["ttft_ms"] == {"median": 131, "min": 130, "max": 132, "n": 3}
    assert pip["exposed_fraction"] == pytest.approx(0.3)  # (131 - 101) / (201 - 101)
    assert pip["target"] == pytest.approx(0.30) and pip["target_met"] is True
    assert pip["exposed_tail"] == pytest.approx(40 / 110)
    h = an.headline(rows, 4096, 128, "m")
    for key in (
        "exposed_fraction_pipelined",
        "groups",
        "ttft_ms",
        "short_prompt_pipelined_over_serial",
    ):
        assert key in h
    assert h["groups"] == 4
    assert h["exposed_fraction_pipelined"] == pytest.approx(0.3)
    assert h["ttft_ms"] == {"colocated": 101, "serial": 201, "pipelined": 131}
    assert h["short_prompt_pipelined_over_serial"] == pytest.approx(22 / 21)
    assert h["serial_overhead"] == pytest.approx(100 / 101)
    assert h["first_token_over_colocated"] == pytest.approx(93 / 101)
    json.dumps(h)  # one plain JSON object
    table = markdown_table(rows)
    assert table.count("\n") == 2 + len(rows) and "| m | 4096 | 1 | pipelined | 4 |" in table


def test_target_missed_is_reported():
    samples = _fake_samples()
    for s in samples:
        if s["mode"] == "pipelined" and s["prompt_len"] == 4096:
            s["ttft_ms"] = 190 + s["run"]
    pip = next(r for r in an.build_rows(samples) if r["mode"] == "pipelined" and r["groups"] == 4)
    assert pip["exposed_fraction"] == pytest.approx(0.9) and pip["target_met"] is False


def test_parse_args_quick_defaults():
    a = bench_ttft.parse_args(["--quick"])
    assert a.lengths == [128, 2048] and a.concurrency == [1] and a.runs >= 3
    assert a.link_gbit == bench_ttft.QUICK_LINK_GBIT and a.sweep_lengths == []
    assert bench_ttft.parse_args(["--quick", "--link-gbit", "1"]).link_gbit == 1.0


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--runs", "0"], "--runs"),
        (["--lengths", "0"], "--lengths"),
        (["--concurrency", "0"], "--concurrency"),
        (["--link-gbit", "0"], "--link-gbit"),
        (["--modes", "serial", "pipelined"], "colocated"),
        (["--lengths", "256", "--sweep-lengths", "512"], "sweep-lengths"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_parse_args_rejects(argv, msg, capsys):
    with pytest.raises(SystemExit):
        bench_ttft.parse_args(argv)
    assert msg in capsys.readouterr().err


def test_plan_sweep_and_batched_cells():
    a = bench_ttft.parse_args(["--lengths", "128", "1024", "4096", "--max-batched-len", "1024"])
    cells = {(n, c): modes for n, c, modes in bench_ttft.plan(a)}
    assert (4096, 8) not in cells and (1024, 8) in cells  # batched only up to 1024
    assert cells[(4096, 1)] == list(an.ALL_MODES)  # the sweep at the longest prompt
    assert cells[(1024, 1)] == list(an.BASE_MODES)

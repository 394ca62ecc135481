"""benchmarks.spec end to end (subprocess, --json) on a tiny checkpoint, and the order in which
it runs its engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import runtime_models as rm

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _bench_json(args: str) -> dict:
    """``benchmarks.spec ARGS --runs 1 --page-size 4 --json`` on the tiny llama -> its JSON."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.spec", "--model", rm.checkpoint("llama"),
         *args.split(), "--runs", "1", "--page-size", "4", "--json"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_bench_spec_json():
    args = "--random-prompts 6 --batches 1 3 --draft-layers 1 4 --spec-tokens 2 --max-tokens 8"
    args += " --ignore-eos"  # every sequence 8 tokens
    args += " --min-confidence 0"  # chains of k: a tiny random model's drafts are never sure
    res = _bench_json(args)
    assert {r["set"] for r in res["results"]} == {"random"} and res["worst_set"] == "random"
    rows = {(r["config"], r["batch"]): r for r in res["results"]}
    assert sorted(rows) == sorted(
        (c, b) for b in (1, 3) for c in ("target only", "self-draft K=1 k=2", "self-draft K=4 k=2")
    )
    for (config, _), r in rows.items():
        assert r["decode_tok_s"] > 0
        if config != "target only":
            assert r["same"] is True  # spec greedy output == target-only output
    # where the steps' time went: a plain step feeds one row a sequence; a verify at batch 1
    # feeds the last token and up to k = 2 drafts (fewer where max_tokens clamps k)
    for (config, b), r in rows.items():
        sp = r["step_split"]
        # the timed calls fit in the steps' time (an eager decode's inner forward counts once)
        assert sp["steps"] > 0 and sp["target_ms"] > 0 and sp["rest_ms"] >= 0
        if config == "target only":
            # up to b rows (the last batch of the 8 prompts at b = 3 has 2)
            assert sp["target_rows"] == 1 if b == 1 else 2 <= sp["target_rows"] <= b
            assert sp["draft_calls"] == 0 and sp["draft_ms"] == 0
        elif b == 1:  # a step drafts or not (the adaptive policy): 1 row, or a verify's 2-3
            assert 1 <= sp["target_rows"] <= 3 and sp["draft_calls"] > 0
    # the whole model as its own draft verified (its acceptance below): more than a row a forward
    assert rows[("self-draft K=4 k=2", 1)]["step_split"]["target_rows"] > 1
    full = rows[("self-draft K=4 k=2", 3)]  # the whole model as its own draft
    assert full["acceptance_rate"] == 1.0 and full["mean_accepted_length"] > 2
    assert rows[("self-draft K=1 k=2", 1)]["acceptance_rate"] < 0.5


def test_bench_spec_eagle_head_with_pd_json():
    """A head (--draft DIR) colocated at batch 1 and 2, then its batch-2 prompts through a
    prefill and a decode stage: the headline keys, and PD gives the colocated tokens."""
    from eagle_heads import trained_head

    head = trained_head(rm.checkpoint("llama"))
    args = f"--random-prompts 6 --batches 1 2 --draft {head} --spec-tokens 2 --max-tokens 8 --pd"
    res = _bench_json(args + " --ignore-eos")
    for key in ("tokens_per_step", "acceptance_rate", "speedup_batch1", "acceptance_pd",
                "acceptance_pd_over_colocated"):  # fmt: skip
        assert key in res, key
        assert res["sets"]["random"][key] == res[key]  # one set: it is the worst
    assert res["pd_same_tokens_as_colocated"] is True
    assert all(r.get("same", True) for r in res["results"])


def test_bench_spec_pd_runs_the_measured_cut():
    """--pd with a cut below the default: the PD decode stage cuts its chains there too, so
    its tokens per verify step are the always-drafting colocated row's at that cut."""
    from eagle_heads import trained_head

    head = trained_head(rm.checkpoint("llama"))
    args = f"--random-prompts 6 --batches 2 --draft {head} --spec-tokens 3 --max-tokens 12 --pd"
    args += " --ignore-eos --policy always --branches 2 --min-confidence 0.02"
    res = _bench_json(args)["sets"]["random"]
    assert res["tokens_per_step_pd"] == res["tokens_per_step_colocated"] == res["tokens_per_step"]
    assert res["pd_same_tokens_as_colocated"] is True


def test_bench_spec_random_head_both_policies_json():
    """--random-head --policy both: an adaptive and an always-drafting row of a random head of
    the trained head's shape; the adaptive one switches drafting off, both are lossless."""
    args = "--random-prompts 6 --batches 1 --random-head --spec-tokens 3 --max-tokens 24"
    rows = {r["config"]: r for r in _bench_json(args + " --policy both --ignore-eos")["results"]}
    assert set(rows) == {"target only", "draft random head k=3", "draft random head k=3 always"}
    adaptive, always = rows["draft random head k=3"], rows["draft random head k=3 always"]
    assert adaptive["adaptive"] and not always["adaptive"]
    assert adaptive["same"] and always["same"]
    assert adaptive["switched_off"] >= 1 and adaptive["undrafted_share"] > 0.5
    assert always["undrafted_steps"] == 0 and always["undrafted_share"] == 0.0


def test_engines_take_turns_group_by_group_each_group_one_further_on(monkeypatch):
    """Every prompt group runs on each engine before the next group, and no engine always runs
    right after the same other one: a fixed turn read 0.91-0.93x for an engine that did the
    target's own work (docs/benchmarks.md, "A head that never pays"); turns of whole runs
    (about 10 s each) let the host's drift between them reach the ratios."""
    from types import SimpleNamespace

    from benchmarks import spec as bench

    order = []

    def fake_run_group(engine, prompts, max_tokens, ignore_eos, split, tag="g"):
        if max_tokens != 4:  # not the warm-up
            order.append((engine, prompts[0][0]))
        return 2 if engine == "a" else 1, 0.5, [prompts[0]]

    monkeypatch.setattr(bench, "run_group", fake_run_group)
    makers = {name: (lambda name=name: name) for name in ("a", "b", "c")}
    args = SimpleNamespace(runs=2, max_tokens=8, ignore_eos=False)
    out = bench.measure(makers, [[[1]], [[2]]], args)
    assert order == [("a", 1), ("b", 1), ("c", 1), ("b", 2), ("c", 2), ("a", 2),
                     ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2)]  # fmt: skip
    assert list(out) == ["a", "b", "c"]
    assert out["a"]["runs_tok_s"] == [4.0, 4.0] and out["b"]["runs_tok_s"] == [2.0, 2.0]
    assert all(r["outputs"] == [[1], [2]] for r in out.values())


def test_speedup_is_the_median_of_each_runs_own_ratio():
    """Run 1 of the head against run 1 of target only, and so on: the median of those ratios,
    not the ratio of the two medians, which here pairs the head's run 2 with target only's
    run 2 of another speed (chat, the issue's command, 2026-11-30: 1.26x of medians, 1.34x
    paired)."""
    from benchmarks import spec as bench

    head, base = [40.19, 42.67, 49.36], [30.07, 33.79, 35.15]
    out = bench.speedup(head, base)
    assert [round(x, 3) for x in out["speedup_runs"]] == [1.337, 1.263, 1.404]
    assert round(out["speedup"], 3) == 1.337 and round(out["speedup_of_medians"], 3) == 1.263

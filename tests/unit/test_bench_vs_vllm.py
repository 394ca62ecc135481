"""benchmarks.vs_vllm without vLLM: the worker protocol of this runtime's worker on a
tiny checkpoint, and the ratios / table built from measured times."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import runtime_models as rm

from benchmarks import vs_vllm as bv

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_ours_worker_protocol():
    cmd = [sys.executable, "-m", "benchmarks.vs_vllm", "--worker", "ours", "--model"]
    cmd += [rm.checkpoint("llama")]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    prompts = [rm.random_prompt(5, seed=1), rm.random_prompt(9, seed=2)]
    req = json.dumps({"prompts": prompts, "max_tokens": 4}) + "\n"
    req += json.dumps({"prompts": prompts, "max_tokens": 4, "wall": True}) + "\n"  # generate()
    out, _ = proc.communicate(req, timeout=120)
    lines = [json.loads(x[len(bv.MARK) :]) for x in out.splitlines() if x.startswith(bv.MARK)]
    assert lines[0] == {"ready": True}
    assert [len(o) for o in lines[1]["outputs"]] == [4, 4]
    assert 0 < lines[1]["first"] < lines[1]["seconds"]  # first tokens, then 3 decode steps
    assert lines[2]["outputs"] == lines[1]["outputs"] and lines[2]["first"] is None
    assert lines[2]["seconds"] > 0


def test_summary_ratios_and_table():
    class Args:
        max_tokens = 5

    times = {"ours": [(1.0, 3.0), (2.0, 4.0)], "base": [(2.0, 6.0)] * 2, "vllm": [(1.0, 5.0)] * 2}
    outputs = {"ours": [[1, 2]], "base": [[1, 3]], "vllm": [[1, 2]]}
    row = bv.summarize(1, 10, "float32", Args, times, outputs)
    assert row["ours_prefill_tok_s"] == 7.5 and row["vllm_prefill_tok_s"] == 10.0
    assert row["prefill_ratio"] == 0.75 and row["decode_ratio"] == 2.0  # 4 tokens: 2 s vs 4 s
    assert row["prefill_ratio_in_run"] == 0.75 and row["decode_ratio_in_run"] == 2.0
    assert row["same"] and not row["base_same"] and row["base_decode_ratio"] == 1.0
    text = bv.table([row], 2)
    assert "| 1 × 10 | float32 | baseline |" in text and "| 1 × 10 | float32 | this |" in text
    assert bv.parse_configs(["8x512", "32X256"]) == [(8, 512), (32, 256)]

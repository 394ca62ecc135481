"""scripts/generate.py end to end (subprocess) on a tiny checkpoint; the generation config that
scripts/convert_smollm2.py writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import runtime_models as rm

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _run(*args: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_generate_prompt_ids_greedy_matches_engine():
    path = rm.checkpoint("qwen2")
    (res,) = _run("--model", path, "--prompt-ids", "5,6,7,8", "--max-tokens", "6")
    runner = load_runner(path)
    engine = LLMEngine(runner, runner.make_pool(8, 4))
    (seq,) = engine.generate([([5, 6, 7, 8], SamplingParams(max_tokens=6))])
    assert res["prompt_ids"] == [5, 6, 7, 8]
    assert res["output_ids"] == seq.output_ids and res["text_output"] == ""


def test_generate_requests_file(tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    lines = [
        {"prompt_ids": [9, 10, 11], "max_tokens": 3},
        {"prompt_ids": [12, 13], "max_tokens": 5, "temperature": 0.9, "seed": 4},
        {"prompt_ids": [12, 13], "max_tokens": 5, "temperature": 0.9, "seed": 4},
    ]
    reqs.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    res = _run("--model", rm.checkpoint("llama"), "--requests", str(reqs), "--ignore-eos")
    assert [len(r["output_ids"]) for r in res] == [3, 5, 5]
    assert res[1]["output_ids"] == res[2]["output_ids"]  # same seed, same draw


def test_converted_generation_config_takes_eos_from_the_model_config():
    """transformers 5.17's GGUF tokenizer reports eos 1 where the model config says 2: the
    converted generation_config.json must keep the model config's ids."""
    import types

    from scripts.convert_smollm2 import generation_config

    tok = types.SimpleNamespace(bos_token_id=1, eos_token_id=1)
    assert generation_config({"bos_token_id": 1, "eos_token_id": 2}, tok) == {
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    assert generation_config({}, tok) == {"bos_token_id": 1, "eos_token_id": 1}

"""Stage parameters, make_repo and text deltas (no Triton, no network)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from backends.stage_params import StageParams, from_triton_config, instance_index, parse_params
from backends.stage_text import text_delta

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")


def test_parse_converts_and_builds_policy_and_transfer_config():
    p = parse_params(
        {
            "page_size": "32",
            "lg_enabled": "false",
            "lg_fixed_group_size": "4",
            "shared_secret": "x" * 16,
            "bootstrap_port": "7000",
        }
    )
    assert p.page_size == 32 and p.lg_enabled is False
    assert p.policy().fixed_group_size == 4 and not p.policy().enabled
    cfg = p.transfer_config(instance_index=2)
    assert cfg.bootstrap_port == 7002 and cfg.shared_secret == b"x" * 16
    assert StageParams().transfer_config().bootstrap_port == 0
    assert os.path.isabs(StageParams().model_path)


@pytest.mark.parametrize(
    "raw,words",
    [
        ({"dtype": "float64"}, ["dtype", "float32"]),
        ({"transport": "udp"}, ["transport", "tcp"]),
        ({"page_size": "abc"}, ["page_size", "integer"]),
        ({"num_pages": "0"}, ["num_pages", ">= 1"]),
        ({"lg_enabled": "maybe"}, ["lg_enabled", "true or false"]),
        ({"lg_min_groups": "9", "lg_max_groups": "8"}, ["lg_", "min_groups"]),
        ({"max_tokens_limit": "4096", "max_context": "2048"}, ["max_tokens_limit", "max_context"]),
        ({"shared_secret": "short"}, ["shared_secret", "16"]),
        ({"bootstrap_timeout_s": "-1"}, ["bootstrap_timeout_s"]),
        ({"pagesize": "16"}, ["unknown parameter", "pagesize"]),
    ],
)
def test_bad_parameters_name_the_parameter(raw, words):
    with pytest.raises(ValueError) as e:
        parse_params(raw)
    for w in words:
        assert w in str(e.value)


def test_triton_config_and_instance_names():
    cfg = {"parameters": {"max_batch": {"string_value": "4"}}}
    assert from_triton_config(cfg).max_batch == 4
    assert instance_index("prefill_0_1") == 1 and instance_index("decode") == 0


def test_make_repo_rewrites_parameters_and_instances(tmp_path):
    out = tmp_path / "repo"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "make_repo.py"),
        "--out",
        str(out),
        "--set",
        "num_pages=64",
        "--set",
        "decode.max_batch=3",
        "--instances",
        "prefill=2",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    pre = (out / "prefill" / "config.pbtxt").read_text()
    dec = (out / "decode" / "config.pbtxt").read_text()
    assert 'key: "num_pages" value: { string_value: "64" }' in pre
    assert 'key: "num_pages" value: { string_value: "64" }' in dec
    assert 'key: "max_batch" value: { string_value: "3" }' in dec
    assert "count: 2" in pre and "count: 1" in dec
    bad = subprocess.run([*cmd[:4], "--set", "dtype=float64"], capture_output=True, text=True)
    assert bad.returncode != 0 and "dtype" in bad.stderr


def test_text_delta_pieces_concatenate_to_the_full_text():
    from backends.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    ids = tok.encode("Café 東京 🙂 naïve — “quotes” and emoji 🎉🎉 end.")
    pieces = [text_delta(tok, ids[max(0, i - 8) : i], ids[i : i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == tok.decode(ids)

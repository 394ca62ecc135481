"""Stage parameters, make_repo, the internal request, preprocessing and text deltas (no Triton)."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from backends.runtime.sampling_params import SamplingParams
from backends.stages import ensemble_io, metrics, params
from backends.stages import request as rq
from backends.stages.params import StageParams, from_triton_config, instance_index, parse_params
from backends.stages.text import sampling_from

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
SECRET = "5e2b9c0d7a41f386"  # strong enough for the rule (backends/stages/keys.py)


def test_parse_converts_and_builds_policy_and_transfer_config():
    p = parse_params(
        {
            "page_size": "32",
            "lg_enabled": "false",
            "lg_fixed_group_size": "4",
            "shared_secret": SECRET,
            "bootstrap_port": "7000",
        }
    )
    assert p.page_size == 32 and p.lg_enabled is False
    assert p.policy().fixed_group_size == 4 and not p.policy().enabled
    cfg = p.transfer_config(instance_index=2)
    assert cfg.bootstrap_port == 7002 and cfg.shared_secret == SECRET.encode()
    assert StageParams().transfer_config().bootstrap_port == 0
    assert os.path.isabs(StageParams().model_path)


@pytest.mark.parametrize(
    "raw,words",
    [
        ({"dtype": "float64"}, ["dtype", "float32"]),
        ({"kv_cache_dtype": "int8"}, ["kv_cache_dtype", "float8_e4m3fn"]),
        ({"transport": "udp"}, ["transport", "tcp"]),
        ({"page_size": "abc"}, ["page_size", "integer"]),
        ({"num_pages": "0"}, ["num_pages", ">= 1"]),
        ({"lg_enabled": "maybe"}, ["lg_enabled", "true or false"]),
        ({"lg_min_groups": "9", "lg_max_groups": "8"}, ["lg_", "min_groups"]),
        ({"max_tokens_limit": "4096", "max_context": "2048"}, ["max_tokens_limit", "max_context"]),
        ({"shared_secret": "short"}, ["shared_secret", "16"]),
        ({"bootstrap_timeout_s": "-1"}, ["bootstrap_timeout_s"]),
        ({"spec_min_confidence": "1"}, ["spec_min_confidence", "[0, 1)"]),
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
    assert from_triton_config(cfg, "decode").max_batch == 4
    assert instance_index("prefill_0_1") == 1 and instance_index("decode") == 0


def test_a_parameter_the_stage_does_not_use_fails_the_load():
    cfg = {"parameters": {"max_batch": {"string_value": "4"}}}
    with pytest.raises(ValueError, match=r"max_batch.*do not apply to stage prefill.*decode"):
        from_triton_config(cfg, "prefill")


def test_defaults_have_one_home():
    """Transfer and layer-group defaults are the kvtransfer classes' own."""
    from backends.stages.fingerprint import deployment_identity
    from backends.stages.policy import LayerGroupPolicy
    from kvtransfer import TransferConfig

    p, tc, lg = StageParams(), TransferConfig(), LayerGroupPolicy()
    assert p.transfer_config() == tc
    assert p.transfer_config(identity=deployment_identity(p)).identity.model_name == (
        "smollm2-135m-instruct"
    )
    assert p.policy() == lg


def test_generated_references_match_the_docs():
    """docs/configuration.md and docs/metrics.md hold the tables generated from the schemas
    (regenerate with scripts/gen_docs.py)."""
    conf = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    assert params.reference_table() in conf
    for name in params.SCHEMA:
        assert f"`{name}`" in conf
    assert metrics.reference_table() in open(os.path.join(ROOT, "docs", "metrics.md")).read()
    assert ensemble_io.reference_table() in open(os.path.join(ROOT, "docs", "serving.md")).read()
    for model, body in ensemble_io.GENERATED.items():  # the configs' inputs and outputs
        config = open(os.path.join(ROOT, "model_repository", model, "config.pbtxt")).read()
        assert body() in config, f"{model}/config.pbtxt is stale: run scripts/gen_docs.py"


def test_request_round_trips_and_rejects_bad_fields():
    req = rq.StageRequest(room=7, prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=3, seed=5))
    back = rq.decode(rq.encode(req.with_bootstrap("127.0.0.1:5000")))
    assert back.sampling == req.sampling and back.bootstrap_addr == "127.0.0.1:5000"
    bad = msgspec.msgpack.encode({"room": 1, "prompt_ids": [1], "sampling": {"top_p": 5.0}})
    with pytest.raises(ValueError, match="top_p"):
        rq.decode(bad)
    with pytest.raises(ValueError, match="REQUEST"):
        rq.decode(b"garbage")


def test_sampling_inputs_map_by_field_name():
    sp = sampling_from(
        {"max_tokens": np.array([5], np.int32), "temperature": np.array([0.5], np.float32),
         "seed": np.array([-1], np.int64), "ignore_eos": np.array([True]), "text_input": "x"}
    )  # fmt: skip
    assert sp == SamplingParams(max_tokens=5, temperature=0.5, seed=None, ignore_eos=True)
    assert sampling_from({"max_tokens": [3], "seed": [42]}).seed == 42
    with pytest.raises(ValueError, match="top_k must hold exactly one value"):
        sampling_from({"max_tokens": [3], "top_k": [1, 2]})


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


def test_streamed_text_pieces_concatenate_to_the_full_text():
    from backends.runtime.detok import TextState
    from backends.runtime.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    ids = tok.encode("Café 東京 🙂 naïve — “quotes” and emoji 🎉🎉 end.")
    state, pieces = TextState(tok), []
    for i in range(len(ids)):
        state.update(ids[: i + 1])
        pieces.append(state.take())
    assert "".join(pieces) + state.take(final=True) == tok.decode(ids)


def test_a_non_loopback_bootstrap_host_needs_a_secret_or_an_explicit_opt_out(monkeypatch):
    monkeypatch.delenv("PD_SHARED_SECRET", raising=False)
    with pytest.raises(ValueError, match="not a loopback address but no shared secret"):
        parse_params({"bootstrap_host": "10.1.2.3"})
    assert parse_params({"bootstrap_host": "127.0.0.1"}).bootstrap_host == "127.0.0.1"
    assert parse_params({"bootstrap_host": "10.1.2.3", "allow_insecure": "true"}).allow_insecure
    p = parse_params({"bootstrap_host": "10.1.2.3", "shared_secret": SECRET})
    assert p.transfer_config().shared_secret == SECRET.encode()
    monkeypatch.setenv("PD_SHARED_SECRET", SECRET[::-1])
    cfg = parse_params({"bootstrap_host": "10.1.2.3"}).transfer_config()
    assert cfg.shared_secret == SECRET[::-1].encode()


def test_make_repo_and_the_parameter_checks_run_without_torch():
    """serve.sh runs make_repo (the stage parameters' checks) and triton_paths at every start;
    loading torch there took 1.8 s of each start (was: params imported it through the device
    and dtype modules)."""
    code = (
        "import sys, runpy\n"
        "import backends.stages.params\n"
        "sys.argv = ['triton_paths.py']\n"
        "runpy.run_path('scripts/triton_paths.py', run_name='__main__')\n"
        "print(sorted(m for m in ('torch', 'pytriton.client') if m in sys.modules))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout

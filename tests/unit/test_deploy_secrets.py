"""Deploy secrets that cannot be left as shipped: the rule (backends/stages/keys.py), the stage
loader and scripts/serve.sh refuse the manifest's placeholder and weak secrets with a message
that says how to make one; serve.sh refuses a front off loopback without an API key, before
it starts anything."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

from backends.stages.keys import PLACEHOLDER, weakness
from backends.stages.params import from_triton_config, parse_params

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "scripts" / "serve.sh"
HOW = "openssl rand -hex 32"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (PLACEHOLDER, "placeholder"),
        (PLACEHOLDER.upper() + "\n", "placeholder"),
        ("short-secret", "too short"),
        ("x" * 64, "different characters"),
        ("abcabcabcabcabcabc", "different characters"),
        ("abcdefgh" * 4, "repeated"),
        ("0123456789abcdef0123456789abcdef", "repeated"),
    ],
)
def test_weak_secrets_are_refused(value, why):
    assert why in (weakness(value) or ""), weakness(value)


def test_random_secrets_pass():
    for _ in range(200):
        assert weakness(secrets.token_hex(32)) is None  # openssl rand -hex 32
        assert weakness(secrets.token_hex(16)) is None
    assert weakness(b"cancel-stats-secret-0123456789") is None


@pytest.mark.parametrize("value", [PLACEHOLDER, "s" * 16])
def test_the_stage_loader_refuses_a_weak_secret_from_the_config_or_the_environment(
    monkeypatch, value
):
    config = {"parameters": {"shared_secret": {"string_value": value}}}
    with pytest.raises(ValueError) as e:
        from_triton_config(config, "decode")
    assert "shared secret" in str(e.value) and HOW in str(e.value)
    monkeypatch.setenv("PD_SHARED_SECRET", value)
    with pytest.raises(ValueError, match="PD_SHARED_SECRET"):
        parse_params({"bootstrap_host": "10.1.2.3"}, "prefill")
    monkeypatch.setenv("PD_SHARED_SECRET", secrets.token_hex(32))
    assert parse_params({"bootstrap_host": "10.1.2.3"}, "prefill").secret


def _serve(tmp_path, *args, env=None):
    """serve.sh on an empty repository: it must stop at its checks (or at the empty repository),
    before any server; one that started anyway is stopped."""
    repo = tmp_path / "empty-repo"
    repo.mkdir(exist_ok=True)
    port = "18999"  # names serve.sh's files only: nothing listens
    cmd = [str(SERVE), "--model-repo", str(repo), "--http-port", port, *args]
    base = {k: v for k, v in os.environ.items() if k not in MINE}
    full = {**base, "PD_RUN_DIR": str(tmp_path / "run"), "PD_SERVE_TIMEOUT": "5", **(env or {})}
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full)
    finally:
        if (tmp_path / "run" / f"tritonserver-{port}.pid").exists():
            stop = [str(SERVE), "--stop", "--http-port", port, "--stop-timeout", "2"]
            subprocess.run(stop, capture_output=True, timeout=60, env=full)


MINE = ("PD_SHARED_SECRET", "PD_API_KEY", "PD_API_KEY_FILE", "PD_INSECURE_NO_API_KEY",
        "PD_OPENAI_HOST")  # fmt: skip


def test_serve_refuses_the_placeholder_secret_before_starting(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(PLACEHOLDER + "\n")  # what deploy/kubernetes/secret.yaml ships
    for args, env in (
        (["--secret-file", str(secret)], None),
        ([], {"PD_SHARED_SECRET": PLACEHOLDER}),
        ([], {"PD_SHARED_SECRET": "aaaaaaaaaaaaaaaaaaaa"}),
    ):
        out = _serve(tmp_path, *args, env=env)
        assert out.returncode == 2, out
        assert "shared secret" in out.stderr and HOW in out.stderr, out.stderr
        assert "no models in" not in out.stderr  # stopped at the secret, before anything else
    secret.write_text(secrets.token_hex(32))  # a good one passes (the empty repository stops)
    out = _serve(tmp_path, "--secret-file", str(secret), "--no-openai")
    assert out.returncode == 2 and "no models in" in out.stderr, out.stderr


def test_serve_refuses_a_front_off_loopback_without_a_key(tmp_path):
    out = _serve(tmp_path, "--openai-host", "0.0.0.0")
    assert out.returncode == 2 and "not a loopback address" in out.stderr, out.stderr
    assert HOW in out.stderr and "no models in" not in out.stderr
    keys = tmp_path / "keys"
    keys.write_text(PLACEHOLDER + "\n")
    out = _serve(tmp_path, "--openai-host", "0.0.0.0", "--api-key-file", str(keys))
    assert out.returncode == 2 and "placeholder" in out.stderr, out.stderr
    keys.write_text(secrets.token_hex(32) + "\n")
    out = _serve(tmp_path, "--openai-host", "0.0.0.0", "--api-key-file", str(keys))
    assert out.returncode == 2 and "no models in" in out.stderr, out.stderr  # past the check

"""One real tritonserver per e2e session (2 instances per stage) and the transformers reference."""

from __future__ import annotations

import os

import pytest
from triton_harness import MAX_CONTEXT, MAX_TOKENS_LIMIT, Reference, Server, launch, stop


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    # "http,grpc,metrics_url,trace_dir,log[,openai base url]" of a running server (debugging)
    reuse = os.environ.get("PD_E2E_SERVER")
    if reuse:
        yield Server(*reuse.split(","))
        return
    sets = [
        "num_pages=256",
        f"max_context={MAX_CONTEXT}",
        f"max_tokens_limit={MAX_TOKENS_LIMIT}",
        "prefill.lg_fixed_group_size=10",  # 3 layer groups even for short prompts
        "bootstrap_timeout_s=10",
    ]
    srv, serve, env = launch(tmp_path_factory.mktemp("triton"), sets, ["prefill=2", "decode=2"])
    yield srv
    stop(srv, serve, env)


@pytest.fixture(scope="session")
def reference():
    return Reference()

"""Prefill and decode on GPUs through a real tritonserver (scripts/gpu_check.sh runs it with
PD_TEST_DEVICE=cuda; skipped on CPU hosts): placement flags, device auto, greedy equality."""

from __future__ import annotations

import os

import pytest
from triton_harness import grpc_ask, launch, stop, wait_pages_free

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        os.environ.get("PD_TEST_DEVICE", "cpu") == "cpu",
        reason="GPU check: run scripts/gpu_check.sh on a CUDA host",
    ),
]

PROMPTS = [
    ("What is the capital of France?", True, 16),
    ("The three primary colors are", False, 12),
]


def test_stages_on_gpus_equal_transformers(tmp_path, reference):
    import torch

    n = torch.cuda.device_count()
    decode_gpu = "1" if n > 1 else "0"  # two GPUs: one per stage; else both on the one
    place = ["--prefill-gpus", "0", "--decode-gpus", decode_gpu]
    srv, serve, env = launch(tmp_path, ["num_pages=256", "max_context=512"], (), place)
    try:
        for stream in (True, False):
            for text, chat, k in PROMPTS:
                fields = {"text_input": text, "max_tokens": k, "apply_chat_template": chat}
                _, ids, err = grpc_ask(srv.grpc, {**fields, "stream": stream})
                assert err is None and ids == reference.greedy(text, chat, k), text
        m = wait_pages_free(srv)
        assert [m[("pd_kv_pages_in_use", s)] for s in ("prefill", "decode")] == [0, 0]
        log = open(srv.log).read()
        assert "running on cuda:0" in log and f"running on cuda:{decode_gpu}" in log
    finally:
        stop(srv, serve, env)

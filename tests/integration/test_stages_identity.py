"""Stage cores (no Triton) of one `--role all` server whose prefill and decode disagree (a
hand-edited repository): prefill serves another checkpoint of the same architecture. The
request fails at once with "model differs" (not after the bootstrap timeout), pages are freed
on both stages, the refusal is counted by reason on both."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from runtime_models import checkpoint, random_prompt
from stagepeer import Collector, PrefillProcess, tiny_params

from backends.runtime.sampling_params import SamplingParams
from backends.stages.decode import DecodeWorker
from backends.stages.params import StageParams
from backends.stages.request import StageRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def other_weights(src: str, dst) -> str:
    """Same config, one weight byte changed."""
    shutil.copytree(src, dst)
    (w,) = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    with open(os.path.join(dst, w), "r+b") as f:
        f.seek(-2, os.SEEK_END)
        b = f.read(1)[0]
        f.seek(-2, os.SEEK_END)
        f.write(bytes([b ^ 1]))
    return str(dst)


def test_prefill_of_another_checkpoint_is_refused_at_once(tmp_path):
    ckpt = checkpoint("llama")
    prefill = PrefillProcess(**tiny_params(other_weights(ckpt, tmp_path / "llama-tuned")))
    decode = DecodeWorker(StageParams(**tiny_params(ckpt)))  # bootstrap_timeout_s=10
    try:
        ids = random_prompt(9, seed=1)
        c = Collector()
        sampling = SamplingParams(max_tokens=4)
        req = StageRequest(room=7, prompt_ids=ids, sampling=sampling, bootstrap_addr=prefill.addr)
        t0 = time.time()
        decode.submit(req, c)
        _first, err = prefill.prefill(7, ids)
        assert c.done.wait(10) and time.time() - t0 < 5
        msg = c.events[-1].error
        assert "KV transfer failed: prefill" in msg
        assert "incompatible deployment: model differs: prefill serves llama-tuned (" in msg
        assert "decode serves llama (" in msg
        assert err  # prefill did not serve it either
        assert decode.stats()["refusals"] == {"model": 1}
        end = time.time() + 5
        while (decode.pages_in_use or prefill.pages_in_use()) and time.time() < end:
            time.sleep(0.05)
        assert decode.pages_in_use == 0 and prefill.pages_in_use() == 0
    finally:
        decode.close()
        prefill.stop()

"""Speculative decoding through PD for ``bench_spec.py --pd``: a prefill stage in its own process
and a decode stage in this one, real Mooncake over loopback, the same prompts as the colocated
runs, greedy; -> the decode stage's acceptance counters (the ones ``/metrics`` exports)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))


def pd_spec_stats(model: str, draft: str, k: int, prompts: list[list[int]], max_tokens: int,
                  page_size: int, ignore_eos: bool = False) -> dict:  # fmt: skip
    from stagepeer import Collector, PrefillProcess

    from backends.runtime.config import ModelConfig
    from backends.runtime.sampler import SamplingParams
    from backends.stages.decode import DecodeWorker
    from backends.stages.params import StageParams
    from backends.stages.request import StageRequest

    per = -(-(max(map(len, prompts)) + max_tokens) // page_size) + 1
    limit = ModelConfig.from_pretrained(model).max_position_embeddings
    params = dict(model_dir=model, page_size=page_size, num_pages=per * len(prompts) + 8,
                  spec_enabled=True, draft_model_dir=draft, spec_tokens=k, spec_max_batch=0,
                  max_batch=len(prompts), bootstrap_timeout_s=60.0,
                  max_context=min(limit, 2048), max_tokens_limit=min(limit, 2048) - 1)  # fmt: skip
    prefill = PrefillProcess(**params)
    decode = DecodeWorker(StageParams(**params))
    try:
        outs = []
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        for i, ids in enumerate(prompts):  # decode registers first, as in the ensemble
            c = Collector()
            decode.submit(StageRequest(room=7000 + i, prompt_ids=ids, sampling=sp,
                                       bootstrap_addr=prefill.addr, stream=True), c)  # fmt: skip
            outs.append(c)
        for i, ids in enumerate(prompts):
            err = prefill.prefill(7000 + i, ids)[1]
            if err:
                raise RuntimeError(f"prefill failed: {err}")
        for c in outs:
            if not c.done.wait(600) or c.events[-1].error:
                raise RuntimeError(f"PD request failed: {c.events[-1].error}")
        st = decode.stats()
        return {"outputs": [c.ids for c in outs], "proposed": st["spec_proposed"],
                "accepted": st["spec_accepted"],
                "acceptance_rate": st["spec_accepted"] / max(1, st["spec_proposed"]),
                "mean_accepted_length": st["spec_mean_accepted_length"]}  # fmt: skip
    finally:
        decode.close()
        prefill.stop()

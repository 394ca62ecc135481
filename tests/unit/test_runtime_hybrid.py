"""The recurrent hybrids (Qwen3-Next, Qwen3.5: gated DeltaNet; Nemotron-H, Granite 4.0-H:
Mamba2) against transformers on tiny random checkpoints: prefill logits over prompts spanning
several chunks of the chunked algorithms and several pages, the state slot after prefill and
after one decode step equal to transformers' cache state, chunked prefill carrying the state,
batched greedy decoding of sequences joining and leaving, bfloat16, slot accounting on every
path, and the refusals."""

from __future__ import annotations

import json
import os

import pytest
import runtime_models as rm
import torch

from backends.runtime.config import ModelConfig, UnsupportedArchitectureError
from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.recurrent.batch import RecurrentStateLost
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import load_draft
from backends.runtime.state_pool import OutOfSlotsError
from backends.runtime.weights import runtime_name

KINDS = ["qwen3_next", "qwen3_5", "nemotron_h", "granite_hybrid"]
# 150 tokens: 3 DeltaNet chunks of 64, 10 Mamba2 chunks of 16, 19 pages of 8
LONG = 150


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def runner(kind):
    return load_runner(rm.checkpoint(kind), device=rm.DEVICE)


def hf_logits(kind: str, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return rm.hf_model(kind)(torch.tensor([prompt])).logits[0].float()  # [T, V]


def prefilled(runner, prompt: list[int], pool=None):
    """(pool, pages, slot, last logits [V]) after prefilling ``prompt`` from position 0."""
    pool = pool or runner.make_pool(64, 8)
    pages, slot = pool.alloc(pool.pages_needed(len(prompt) + 16)), pool.states.alloc()
    return pool, pages, slot, runner.prefill(pool, prompt, pages, slot=slot)


def test_config_names_the_layers_and_the_state_layout(kind, runner):
    cfg, spec = runner.config, runner.make_pool(4, 8).states.spec
    assert cfg.has_recurrent_state and cfg.num_layers == 4
    if kind == "nemotron_h":
        assert cfg.layer_types == ("mamba", "mlp", "full_attention", "mamba")
        assert cfg.kv_layers == (2,) and cfg.recurrent_layers == (0, 3)
        # [x | B | C] conv channels (4 x 16, 2 x 16, 2 x 16) x (K - 1 = 3), then S [4, 16, 16]
        assert [(s.name, s.heads, s.elems_per_head) for s in spec.segments] == [
            ("conv_x", 4, 48),
            ("conv_B", 2, 48),
            ("conv_C", 2, 48),
            ("ssm", 4, 256),
        ]
    elif kind == "granite_hybrid":
        assert cfg.layer_types == ("mamba", "full_attention", "mamba", "mamba")
        assert cfg.kv_layers == (1,) and cfg.recurrent_layers == (0, 2, 3)
        assert cfg.softmax_scale == 0.2 and cfg.logits_scaling == 2.0  # Granite's multipliers
        # [x | B | C] conv channels (4 x 32, 2 x 16, 2 x 16) x 3, then S [4, 32, 16]
        assert [(s.name, s.heads, s.elems_per_head) for s in spec.segments] == [
            ("conv_x", 4, 96),
            ("conv_B", 2, 48),
            ("conv_C", 2, 48),
            ("ssm", 4, 512),
        ]
    else:
        assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert cfg.kv_layers == (3,) and cfg.recurrent_layers == (0, 1, 2)
        assert cfg.rope.dim == 4  # partial rotary: a quarter of the 16 channels
        # [q | k | v] conv channels (2 x 8, 2 x 8, 4 x 16) x 3, then S [4, 8, 16]
        assert [(s.name, s.heads, s.elems_per_head) for s in spec.segments] == [
            ("conv_q", 2, 24),
            ("conv_k", 2, 24),
            ("conv_v", 4, 48),
            ("recurrent", 4, 128),
        ]
    offsets = [s.offset for s in spec.segments]
    sizes = [s.elems for s in spec.segments]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]  # back to back, in order
    assert spec.slot_bytes == 4 * sum(sizes)  # float32
    states = runner.make_pool(4, 8, num_slots=3).states
    assert states.slabs.shape == (len(cfg.recurrent_layers), 3, sum(sizes))
    layout = states.layout  # the kvtransfer entry over the same buffer
    assert layout.role == "target.state" and layout.attn == "state"
    assert tuple(states.tensor.shape) == layout.buffer_shape()
    g = spec.groups  # every sub-block splits into g groups of heads alike
    assert layout.kv_heads == layout.total_kv_heads == g
    assert all(s.heads % g == 0 for s in spec.segments)
    assert layout.segments == tuple((s.heads // g, s.elems_per_head) for s in spec.segments)
    assert layout.page_bytes == spec.slot_bytes
    assert layout.base_addr == states.slabs.data_ptr()
    # the KV pool holds the attention layers only
    assert runner.make_pool(4, 8).layout.num_layers == len(cfg.kv_layers)


def test_prefill_logits_match_transformers(kind, runner):
    prompt = rm.random_prompt(LONG, seed=3)
    ref = hf_logits(kind, prompt)
    pool = runner.make_pool(32, 8)
    pool.shuffle_free_list(seed=1)  # fragmented page tables
    seq = SeqInput(prompt, 0, pool.alloc(pool.pages_needed(LONG)), pool.states.alloc())
    rm.assert_close_to_reference(runner.forward(pool, [seq])[0], ref)


def _reference_states(kind: str, prompt: list[int], next_token: int):
    """transformers' cache after the prompt, and after one more token: per recurrent layer
    (conv state [C, K], recurrent state)."""
    model = rm.hf_model(kind)
    layers = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache = out.cache

        def grab():
            return [
                (cache.get_conv_state(i)[0].clone(), cache.get_recurrent_state(i)[0].clone())
                for i in layers
            ]

        after_prompt = grab()
        model(torch.tensor([[next_token]]), cache=cache, use_cache=True)
        return after_prompt, grab()


def _slot_states(pool, slot: int):
    """Per recurrent layer of the runtime's pool: (conv state [C, K - 1], recurrent state)."""
    spec, out = pool.states.spec, []
    for r in range(spec.num_layers):
        row = pool.states.slabs[r, slot]
        rec = spec.segments[-1]
        conv = row[: rec.offset]
        channels = sum(s.elems for s in spec.segments[:-1]) // 3  # K - 1 = 3
        out.append((conv.view(channels, 3), row[rec.offset :]))
    return out


def _assert_states_equal(got, want):
    for (conv, rec), (ref_conv, ref_rec) in zip(got, want, strict=True):
        # transformers keeps K inputs; the runtime the K - 1 a later token reads
        torch.testing.assert_close(conv, ref_conv[:, 1:].float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rec, ref_rec.reshape(-1).float(), atol=1e-5, rtol=1e-5)


def test_slot_after_prefill_and_one_decode_step_equals_transformers_cache(kind, runner):
    """Prefill of N tokens leaves exactly transformers' state after N tokens; one decode step
    advances it by exactly one token. Feeding the last prompt token again (the trap of a decode
    that recomputes it) would give another state: the comparison sees that."""
    prompt = rm.random_prompt(37, seed=5)
    after_prompt, after_next = _reference_states(kind, prompt, next_token=42)
    pool, pages, slot, _ = prefilled(runner, prompt)
    _assert_states_equal(_slot_states(pool, slot), after_prompt)
    runner.decode(pool, [42], [len(prompt)], [pages], [slot])
    _assert_states_equal(_slot_states(pool, slot), after_next)
    # the trap: the last prompt token applied a second time moves the state elsewhere
    pool2, pages2, slot2, _ = prefilled(runner, prompt)
    runner.decode(pool2, [prompt[-1]], [len(prompt) - 1], [pages2], [slot2])
    with pytest.raises(AssertionError):
        _assert_states_equal(_slot_states(pool2, slot2), after_prompt)


def test_chunked_prefill_carries_the_state(kind, runner):
    """A prompt prefilled in three chunks (boundaries inside the algorithms' chunks and pages)
    gives the one-shot prefill's logits, and greedy decoding from it equals transformers'."""
    prompt = rm.random_prompt(100, seed=6)
    _, _, _, whole = prefilled(runner, prompt)
    pool = runner.make_pool(64, 8)
    pages, slot = pool.alloc(pool.pages_needed(len(prompt) + 8)), pool.states.alloc()
    for a, b in ((0, 37), (37, 70), (70, 100)):
        last = runner.prefill(pool, prompt[a:b], pages, start_pos=a, slot=slot)
    rm.assert_close_to_reference(last, whole)
    rm.assert_close_to_reference(last, hf_logits(kind, prompt)[-1])
    rm.assert_greedy_continues(kind, runner, pool, pages, slot, prompt, last)


def test_batched_greedy_with_sequences_joining_and_leaving(kind, runner):
    rm.assert_slots_join_and_leave(kind, runner)  # (its docstring says what it checks)


def test_bfloat16_greedy_matches_transformers_bfloat16(kind):
    runner = load_runner(rm.checkpoint(kind), dtype="bfloat16", device=rm.DEVICE)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(rm.checkpoint(kind), dtype=torch.bfloat16).eval()
    pool = runner.make_pool(64, 8)
    assert pool.tensor.dtype == torch.bfloat16 and pool.states.slabs.dtype == torch.float32
    engine = LLMEngine(runner, pool, max_batch=2)
    prompts = [rm.random_prompt(n, seed=20 + n) for n in (9, 90)]
    seqs = engine.generate([(p, SamplingParams(max_tokens=16)) for p in prompts])
    equal = 0
    for prompt, seq in zip(prompts, seqs, strict=True):
        want = rm.greedy_generate(hf, prompt, 16)
        equal += rm.assert_greedy_matches_up_to_tie(hf, prompt, seq.output_ids, want, rm.BF16_TIE)
    assert equal >= 16  # at most one of the two parts at a tie, and not at once


def _broken(*args, **kwargs):
    """A layer that fails (in place of a real one)."""
    raise RuntimeError("injected failure")


def test_slots_are_freed_exactly_once_on_every_path(runner):
    pool = runner.make_pool(64, 8, num_slots=3)
    states = pool.states
    engine = LLMEngine(runner, pool, max_batch=4)
    prompt = rm.random_prompt(20, seed=7)
    for i in range(4):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30))
    engine.step()  # three admitted (three slots), the fourth waits for one
    assert states.slots_in_use == 3 and len(engine.waiting) == 1
    engine.abort("r0")  # running: its slot and pages go back
    engine.abort("r3")  # waiting: it held none
    assert states.slots_in_use == 2
    # a decode step that fails after the recurrent layers ran: no retry one by one (the states
    # moved), every sequence of it fails, and its slot is freed once
    layers = runner.model.layers
    last = layers[-1]
    layers[-1] = _broken
    try:
        out = engine.step()
    finally:
        layers[-1] = last
    assert set(out.errors) == {"r1", "r2"} and "RecurrentStateLost" in out.errors["r1"]
    assert states.num_free == 3 and pool.num_free == 64 and not engine.has_unfinished()
    # the page rules: a double free raises, an empty pool raises a clear error
    slot = states.alloc()
    states.free(slot)
    with pytest.raises(ValueError, match="double free"):
        states.free(slot)
    held = [states.alloc() for _ in range(3)]
    with pytest.raises(OutOfSlotsError, match="out of slots"):
        states.alloc()
    for s in held:
        states.free(s)


def test_a_slot_is_required_and_its_state_starts_from_zero(runner):
    prompt = rm.random_prompt(12, seed=8)
    pool = runner.make_pool(16, 8)
    pages = pool.alloc(2)
    with pytest.raises(ValueError, match="state slot"):
        runner.prefill(pool, prompt, pages)  # no slot: refused before any compute
    engine = LLMEngine(runner, pool)
    with pytest.raises(ValueError, match="state slot"):  # PD: the prompt's state must come too
        engine.add_prefilled("p", prompt, pages, 5, SamplingParams(max_tokens=4))
    # a reused slot with garbage in it: a prefill from position 0 ignores what it holds
    slot = pool.states.alloc()
    clean = runner.prefill(pool, prompt, pages, slot=slot)
    pool.states.slabs[:, slot] = 7.0
    torch.testing.assert_close(runner.prefill(pool, prompt, pages, slot=slot), clean)
    # a failure in a batch that continues a state is typed (the engine must not retry it); in
    # a prefill from position 0 it is not (a retry starts from zeros)
    layers, first = runner.model.layers, runner.model.layers[0]
    layers[0] = _broken
    try:
        with pytest.raises(RecurrentStateLost):
            runner.decode(pool, [3], [len(prompt)], [pages], [slot])
        with pytest.raises(RuntimeError, match="injected") as caught:
            runner.prefill(pool, prompt, pages, slot=slot)
        assert not isinstance(caught.value, RecurrentStateLost)
    finally:
        layers[0] = first


def test_spec_tensor_parallel_and_fp8_kv_are_refused_at_load(kind, runner):
    path = rm.checkpoint(kind)
    with pytest.raises(ValueError, match="speculative decoding .* recurrent"):
        load_draft(runner, num_layers=2)
    # tensor parallelism splits the state's 2 head groups (test_runtime_tp_hybrid), not 4 ways
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the 2 head"):
        load_runner(path, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="float8_e4m3fn .* recurrent"):
        load_runner(path, kv_cache_dtype="float8_e4m3fn")
    from backends.runtime.prefix_cache import check_prefix_cacheable

    with pytest.raises(Exception, match="recurrent"):
        check_prefix_cacheable(runner.config)


def _config(kind: str) -> dict:
    with open(os.path.join(rm.checkpoint(kind), "config.json")) as f:
        return json.load(f)


def test_older_config_forms_and_what_is_refused():
    """Nemotron-H's ``hybrid_override_pattern`` and original ``backbone.`` tensor names; its MoE
    layers, another MLP activation and a Llama with partial rotary are refused, naming why."""
    raw = {k: v for k, v in _config("nemotron_h").items() if k != "layers_block_type"}
    cfg = ModelConfig.from_dict({**raw, "hybrid_override_pattern": "M-*M"})
    assert cfg.layer_types == ("mamba", "mlp", "full_attention", "mamba")
    assert runtime_name("backbone.layers.0.mixer.A_log") == "model.layers.0.mixer.A_log"
    assert runtime_name("backbone.embeddings.weight") == "model.embed_tokens.weight"
    with pytest.raises(UnsupportedArchitectureError, match="mixture-of-experts"):
        ModelConfig.from_dict({**raw, "hybrid_override_pattern": "M-*E"})
    with pytest.raises(UnsupportedArchitectureError, match="mlp_hidden_act"):
        ModelConfig.from_dict({**_config("nemotron_h"), "mlp_hidden_act": "gelu"})
    with pytest.raises(UnsupportedArchitectureError, match="layer types"):
        ModelConfig.from_dict({**_config("qwen3_next"), "layer_types": ["mamba"] * 4})
    llama = _config("llama")
    rope = {**llama["rope_parameters"], "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedArchitectureError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**llama, "rope_parameters": rope})

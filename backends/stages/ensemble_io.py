"""The ensemble's client-facing inputs and outputs: ONE table each (name, type, shape, meaning).

The ``input [...]`` / ``output [...]`` blocks of the ensemble's, preprocess's and postprocess's
``config.pbtxt`` and the table in ``docs/serving.md`` are generated from it
(``scripts/gen_docs.py``; a unit test fails when one is stale). Sampling inputs carry the name of
their :class:`~backends.runtime.sampler.SamplingParams` field: preprocess reads them by name.
"""

from __future__ import annotations

from typing import NamedTuple


class Tensor(NamedTuple):
    name: str
    dtype: str  # Triton TYPE_* without the prefix
    dims: str  # "1" or "-1"
    doc: str


def _table(text: str) -> list[Tensor]:
    """Rows ``name | TYPE | dims | meaning`` -> tensors."""
    rows = [ln.split(" | ", 3) for ln in text.strip().splitlines()]
    return [Tensor(*(c.strip() for c in row)) for row in rows]


INPUTS = _table(r"""
text_input | STRING | 1 | the prompt
input_ids | INT32 | -1 | the prompt as token ids (instead of text)
messages | STRING | 1 | a chat as JSON `[{"role": "system"\|"user"\|"assistant", "content": "..."}]`, rendered with the checkpoint's chat template (instead of text)
apply_chat_template | BOOL | 1 | wrap `text_input` as one user turn of the chat
max_tokens | INT32 | 1 | tokens to generate (default: `default_max_tokens`)
temperature | FP32 | 1 | 0 = greedy (default)
top_p | FP32 | 1 | nucleus sampling, (0, 1]
top_k | INT32 | 1 | 0 = off
seed | INT64 | 1 | per-request RNG seed (-1 = none)
presence_penalty | FP32 | 1 | [-2, 2]: subtracted once from every token already generated
frequency_penalty | FP32 | 1 | [-2, 2]: subtracted once per time a token was generated
repetition_penalty | FP32 | 1 | > 0, 1 = off: divides positive (multiplies negative) logits of prompt and output tokens
stop | STRING | -1 | stop strings: generation ends when the text contains one; it is not returned
stop_words | STRING | -1 | the same as `stop` (TensorRT-LLM's name)
stop_token_ids | INT32 | -1 | generation ends after one of these tokens
ignore_eos | BOOL | 1 | generate `max_tokens` tokens whatever the model says
top_logprobs | INT32 | 1 | N >= 0: return each token's log-probability and the N most likely ones in `logprobs` (-1 = off)
stream | BOOL | 1 | one response per decode step (else one at the end)
echo | BOOL | 1 | the first response's text starts with the prompt's
exclude_input_in_output | BOOL | 1 | the negation of `echo` (vLLM's name)
sampling_parameters | STRING | 1 | the sampling fields as one JSON object (vLLM backend format), e.g. `{"max_tokens": 8, "stop": ["\n"]}`
return_num_input_tokens | BOOL | 1 | accepted; `num_input_tokens` always comes
return_num_output_tokens | BOOL | 1 | accepted; `num_output_tokens` always comes
return_logprobs | BOOL | 1 | accepted; `logprobs` comes when asked for
""")  # noqa: E501

OUTPUTS = _table(r"""
text_output | STRING | 1 | the text these tokens add (stop strings cut)
output_ids | INT32 | -1 | the tokens of this response
finish_reason | STRING | 1 | `stop` (EOS, stop string or stop token) or `length` on the last response, else ""
num_input_tokens | UINT32 | 1 | prompt tokens
num_cached_tokens | UINT32 | 1 | of those, served from the prefix cache (no one computed them)
num_output_tokens | UINT32 | 1 | tokens in this response
logprobs | STRING | 1 | JSON per token `{id: {logprob, rank, decoded_token}}` (chosen + top N), or `null`
""")  # noqa: E501


def pbtxt(kind: str, tensors: list[Tensor], optional: bool) -> str:
    """The ``input [...]`` or ``output [...]`` block of a config.pbtxt."""
    opt = ", optional: true" if optional else ""
    rows = [
        f'  {{ name: "{t.name}", data_type: TYPE_{t.dtype}, dims: [ {t.dims} ]{opt} }}'
        for t in tensors
    ]
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def reference_table() -> str:
    rows = ["| | name | type | shape | meaning |", "|---|---|---|---|---|"]
    for kind, tensors in (("input", INPUTS), ("output", OUTPUTS)):
        rows += [f"| {kind} | `{t.name}` | {t.dtype} | [{t.dims}] | {t.doc} |" for t in tensors]
    return "\n".join(rows) + "\n"


def ensemble_body() -> str:
    """The ensemble's inputs, outputs and steps: preprocess -> prefill -> decode ->
    postprocess (one REQUEST tensor between the first three, one RESPONSE after decode)."""
    pre = "".join(f'      input_map {{ key: "{t.name}" value: "{t.name}" }}\n' for t in INPUTS)
    post = "".join(f'      output_map {{ key: "{t.name}" value: "{t.name}" }}\n' for t in OUTPUTS)
    # a table, one step a row (model, its input_map, its output_map): `fmt: skip` keeps it one
    steps = [
        ("preprocess", pre, '      output_map { key: "REQUEST" value: "request" }\n'),
        ("prefill", '      input_map { key: "REQUEST" value: "request" }\n',
         '      output_map { key: "REQUEST" value: "routed_request" }\n'),
        ("decode", '      input_map { key: "REQUEST" value: "routed_request" }\n',
         '      output_map { key: "RESPONSE" value: "response" }\n'),
        ("postprocess", '      input_map { key: "RESPONSE" value: "response" }\n', post),
    ]  # fmt: skip
    body = ",\n".join(
        f'    {{\n      model_name: "{m}"\n      model_version: -1\n{i}{o}    }}'
        for m, i, o in steps
    )
    return (
        pbtxt("input", INPUTS, True)
        + pbtxt("output", OUTPUTS, False)
        + f"ensemble_scheduling {{\n  step [\n{body}\n  ]\n}}\n"
    )


GENERATED = {  # config.pbtxt of a model -> its generated part
    "ensemble": ensemble_body,
    "preprocess": lambda: pbtxt("input", INPUTS, True),
    "postprocess": lambda: pbtxt("output", OUTPUTS, False),
}

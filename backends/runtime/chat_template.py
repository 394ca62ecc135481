"""A checkpoint's chat template (Jinja), rendered the way Hugging Face checkpoints expect.

The template is the checkpoint's own text (``chat_template.jinja``, else ``chat_template`` in
``tokenizer_config.json``), so it is code the operator chose to serve; it still runs in Jinja's
immutable sandbox. What a template may use, as transformers gives it:
- blocks trimmed (``trim_blocks``, ``lstrip_blocks``) and ``{% break %}`` / ``{% continue %}``;
- ``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (None here), and the
  tokenizer's special tokens by name (``bos_token``, ``eos_token``, ...);
- ``raise_exception(msg)``, ``strftime_now(fmt)``, and ``tojson`` that keeps non-ASCII text.

A template that raises (an unsupported role, a turn order it refuses) raises
:class:`ChatTemplateError`, a ``ValueError``: the request gets that message as its error.
"""

from __future__ import annotations

import datetime
import functools
import json

import jinja2
import jinja2.ext
import jinja2.sandbox


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own filter escapes HTML characters ('<' as \u003c): templates want the text as is
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_now)
    return env.from_string(source)


def render(source: str, messages: list[dict], add_generation_prompt: bool, **tokens) -> str:
    """The text of ``messages`` in the template ``source``; ``tokens``: the special tokens by
    name (``bos_token="<s>"``, ...)."""
    try:
        template = _compile(source)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
            documents=None, **tokens,
        )  # fmt: skip
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from None

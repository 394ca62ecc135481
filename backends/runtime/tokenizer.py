"""Tokenizer of a checkpoint directory: encoding (optionally with the chat template), decoding.

It reads what Hugging Face tokenizers save and uses the ``tokenizers`` library and Jinja alone,
no transformers and no torch: a stage process that only tokenizes (preprocess, postprocess)
starts in well under a second, where transformers' ``AutoTokenizer`` took about 2.5 s of CPU
(its import, then its model config's import pulled in ``torch.distributed``) on top of torch's
1.6 s, in every stage process of every server start.

What it reads, as transformers 5 does (token for token equal: tests/unit/test_tokenizer.py):
- ``tokenizer.json``: the whole pipeline (normalizer, pre-tokenizer, model, post-processor,
  decoder, added tokens);
- ``tokenizer_config.json``, when there is one: the special tokens by name (a string, or an
  added token's fields), ``add_bos_token`` / ``add_eos_token`` (given, they replace the
  post-processor: BOS before the text and EOS after it, each where asked),
  ``clean_up_tokenization_spaces`` (kept off for BPE, as transformers does), ``chat_template``;
- ``chat_template.jinja``, which newer checkpoints save instead of the config's entry.

Incremental detokenization of a stream, with stop strings: :mod:`backends.runtime.detok`.
"""

from __future__ import annotations

import functools
import json
import os

import tokenizers
from tokenizers import processors

from . import chat_template

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
EXTRA_TOKENS = ("additional_special_tokens", "extra_special_tokens")
# transformers' clean-up of decoded text (WordPiece-era spacing before punctuation)
_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]  # fmt: skip


def _content(token) -> str | None:
    """A special token's text: tokenizer_config writes a string or an added token's fields."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


class Tokenizer:
    def __init__(self, path: str):
        if not has_tokenizer(path):
            raise FileNotFoundError(
                f"no tokenizer in model directory {path!r}: expected tokenizer.json (transformers'"
                " save_pretrained writes it)"
            )
        self.raw = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        self.special = {n: t for n in NAMED_TOKENS if (t := _content(cfg.get(n))) is not None}
        self._add_missing_special_tokens(cfg)
        add_bos, add_eos = bool(cfg.get("add_bos_token")), bool(cfg.get("add_eos_token"))
        if "add_bos_token" in cfg or "add_eos_token" in cfg or self.raw.post_processor is None:
            self._bos_eos_post_processor(add_bos, add_eos)
        eos = self.special.get("eos_token")
        self.eos_token_id = None if eos is None else self.raw.token_to_id(eos)
        self.vocab_size = self.raw.get_vocab_size(with_added_tokens=True)
        bpe = type(self.raw.model).__name__ == "BPE"
        self._clean_up = bool(cfg.get("clean_up_tokenization_spaces")) and not bpe
        self.chat_template = _chat_template(path, cfg)

    def _add_missing_special_tokens(self, cfg: dict) -> None:
        """The config's special tokens that tokenizer.json does not list as added tokens become
        special added tokens (an existing vocabulary entry keeps its id)."""
        listed = [cfg.get(n) or () for n in EXTRA_TOKENS]  # a list, or names -> tokens
        extra = [_content(t) for x in listed for t in (x.values() if isinstance(x, dict) else x)]
        added = {t.content for t in self.raw.get_added_tokens_decoder().values()}
        missing = [t for t in [*self.special.values(), *extra] if t and t not in added]
        if missing:
            self.raw.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in missing])

    def _bos_eos_post_processor(self, bos: bool, eos: bool) -> None:
        marks = {}
        for name, on in (("bos_token", bos), ("eos_token", eos)):
            token = self.special.get(name)
            if on and token is not None:
                marks[name] = (token, self.raw.token_to_id(token))
        b, e = marks.get("bos_token"), marks.get("eos_token")
        single = f"{b[0] + ':0 ' if b else ''}$A:0{' ' + e[0] + ':0' if e else ''}"
        pair = f"{single}{' ' + b[0] + ':1' if b else ''} $B:1{' ' + e[0] + ':1' if e else ''}"
        self.raw.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(marks.values())
        )

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of ``text``; ``chat=True`` wraps it as one user turn of the chat template
        and appends the assistant prompt."""
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return self.encode_text(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (``[{"role", "content"}, ...]``) rendered with the checkpoint's
        own chat template, ending with the assistant prompt."""
        return self.encode_text(self.render_chat(messages), special=False)

    def render_chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> str:
        """The text of a chat in the checkpoint's chat template, ending with the assistant
        prompt unless ``generation_prompt`` is false (its ids: ``encode_text(text,
        special=False)``). ``ValueError`` when there is no template or the template refuses
        the chat."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template: send text_input instead")
        return chat_template.render(self.chat_template, messages, generation_prompt, **self.special)

    def encode_text(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text`` as is (``special``: with the tokenizer's BOS and the like)."""
        return self.raw.encode(text, add_special_tokens=special).ids

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of a text one token can stand for, when that is bounded: then a text
        of B UTF-8 bytes encodes to at least ceil(B / max_token_bytes) tokens, a bound that
        needs no tokenization. Bounded for byte-level BPE without a normalizer (GPT-2, Llama 3,
        Qwen, SmolLM2): every token stands for a run of the text's bytes, as many as its
        string has characters (one per byte), an added token for its content. None otherwise:
        a normalizer can shrink a text, and an added token that strips the spaces beside it
        stands for any number of them."""
        spec = json.loads(self.raw.to_str())
        pre = spec.get("pre_tokenizer") or {}
        pres = pre.get("pretokenizers") or [pre]
        byte_level = any(p and p.get("type") == "ByteLevel" for p in pres)
        model = spec.get("model") or {}
        if spec.get("normalizer") or model.get("type") != "BPE" or not byte_level:
            return None
        added = spec.get("added_tokens") or []
        if any(a.get("lstrip") or a.get("rstrip") for a in added):
            return None
        longest = max((len(t) for t in model.get("vocab", {})), default=0)
        return max([longest, *(len(a["content"].encode()) for a in added)]) or None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.raw.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text


def _read_json(file: str) -> dict | None:
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _chat_template(path: str, cfg: dict) -> str | None:
    """``chat_template.jinja`` if the checkpoint has one, else the config's entry (a string, or
    named templates: the one named ``default``)."""
    file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return f.read()
    entry = cfg.get("chat_template")
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        return named.get("default")
    return entry if isinstance(entry, str) else None


def has_tokenizer(path: str) -> bool:
    """Whether the checkpoint directory ``path`` ships a tokenizer (its ``tokenizer.json``)."""
    return os.path.isfile(os.path.join(path, "tokenizer.json"))

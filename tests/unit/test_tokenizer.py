"""backends.runtime.tokenizer (tokenizers + Jinja, no transformers) against transformers'
AutoTokenizer, the reference, on the same checkpoint directories: SmolLM2's, and tokenizers of
other kinds saved by transformers (byte-level BPE with BOS added by the config, WordPiece with
its spacing clean-up, Metaspace BPE with BOS and EOS, one without a post-processor and with a
config special token that tokenizer.json lacks; chat templates in the config, in
chat_template.jinja, and as named templates). Token ids, decoded text with and without the
special tokens, rendered chats with and without the assistant prompt, EOS id and vocabulary
size must all be equal. And the text stages start without torch or transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from backends.runtime.chat_template import ChatTemplateError
from backends.runtime.tokenizer import Tokenizer
from backends.stages.errors import InvalidRequest
from backends.stages.params import StageParams
from backends.stages.text import Preprocessor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = os.path.join(ROOT, "models", "smollm2-135m-instruct")

CORPUS = [
    "The cat sat on the mat. It's a cat, isn't it? Don't worry, we're fine!",
    "def square(x):\n    return x ** 2  # the square",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "naïve café, 日本語 and emoji 🙂 in one line",
] * 20
TEXTS = [
    "Hello world", " leading space", "What is the capital of France?", "🙂 日本 naïve café",
    "a\n\n\tb  c", "", "it 's don 't . , ! ?", "def f(x):\n    return x ** 2",
    "<s> inside </s> the text", "<|im_start|>user\nhi<|im_end|>", "x" * 300, "a<tool>b<pad>",
]  # fmt: skip
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": 'Say "<b>" 日本'},
     {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Again?"}],
]  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _trained(model, trainer, pre, decoder, normalizer=None) -> RawTokenizer:
    tok = RawTokenizer(model)
    tok.pre_tokenizer, tok.decoder = pre, decoder
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _save(path, tok: RawTokenizer, template_file: bool = False, **config) -> str:
    template = config.pop("chat_template", None)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **config)
    if template is not None and not template_file:
        fast.chat_template = template
    fast.save_pretrained(str(path))
    if template_file:
        (path / "chat_template.jinja").write_text(template)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(path)


def byte_bpe(path) -> str:
    specials = ["<s>", "</s>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = _trained(models.BPE(unk_token="<unk>"), trainer, pre, decoders.ByteLevel())
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    return _save(path, tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                 add_bos_token=True, chat_template=TEMPLATE)  # fmt: skip


def wordpiece(path) -> str:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok = _trained(models.WordPiece(unk_token="[UNK]"),
                   trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials),
                   pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(),
                   normalizers.BertNormalizer(lowercase=True))  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    return _save(path, tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[CLS]",
                 eos_token="[SEP]", clean_up_tokenization_spaces=True, chat_template=TEMPLATE,
                 template_file=True)  # fmt: skip


def metaspace(path) -> str:
    specials = ["<unk>", "<s>", "</s>"]
    tok = _trained(models.BPE(unk_token="<unk>"),
                   trainers.BpeTrainer(vocab_size=300, special_tokens=specials),
                   pre_tokenizers.Metaspace(), decoders.Metaspace())  # fmt: skip
    return _save(path, tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                 add_bos_token=True, add_eos_token=True,
                 chat_template=[{"name": "default", "template": TEMPLATE},
                                {"name": "tool_use", "template": "{{ 'unused' }}"}])  # fmt: skip


def bare(path) -> str:
    """No post-processor in tokenizer.json; a pad token and an extra special token that only
    the config names."""
    tok = _trained(models.BPE(unk_token="<unk>"),
                   trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]),
                   pre_tokenizers.Whitespace(), decoders.BPEDecoder())  # fmt: skip
    out = _save(path, tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                pad_token="<pad>", extra_special_tokens=["<tool>"])  # fmt: skip
    spec = json.loads((path / "tokenizer.json").read_text())  # transformers listed them there too
    config_only = ("<pad>", "<tool>")
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] not in config_only]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return out


@pytest.fixture(scope="module", params=["smollm2", "byte_bpe", "wordpiece", "metaspace", "bare"])
def checkpoint(request, tmp_path_factory):
    if request.param == "smollm2":
        return SMOLLM2
    return globals()[request.param](tmp_path_factory.mktemp(request.param))


def test_equals_transformers(checkpoint):
    hf, ours = AutoTokenizer.from_pretrained(checkpoint), Tokenizer(checkpoint)
    assert (ours.eos_token_id, ours.vocab_size) == (hf.eos_token_id, len(hf))
    for text in TEXTS:
        for special in (True, False):
            ids = hf(text, add_special_tokens=special).input_ids
            assert ours.encode_text(text, special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text
    if not getattr(hf, "chat_template", None):
        with pytest.raises(ValueError, match="no chat template"):
            ours.render_chat(CHATS[0])
        return
    for chat in CHATS:
        for prompt in (True, False):
            want = hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
            assert ours.render_chat(chat, prompt) == want
        want = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True).input_ids
        assert ours.encode_chat(chat) == want


def test_a_chat_the_template_refuses_is_that_request_s_invalid_request(tmp_path):
    """The template's raise_exception is the client's error (400), not the stage's (500): the
    preprocess stage answers it as an invalid ``messages`` and keeps serving."""
    path = byte_bpe(tmp_path)
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        Tokenizer(path).render_chat(twice)
    pre = Preprocessor(StageParams(model_dir=path))
    with pytest.raises(InvalidRequest, match="roles must alternate") as e:
        pre.build({"messages": json.dumps(twice)})
    assert e.value.param == "messages"
    assert pre.build({"messages": json.dumps(twice[:1])}).prompt_ids


def test_a_checkpoint_without_tokenizer_json_is_refused_clearly(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="expected tokenizer.json"):
        Tokenizer(str(tmp_path))


def test_the_text_stages_start_without_torch_or_transformers():
    """preprocess and postprocess only tokenize: their processes import neither (each cost
    seconds of CPU in every stage process of every server start)."""
    code = (
        "import sys\n"
        "from backends.stages.params import StageParams\n"
        "from backends.stages import triton_glue\n"
        "from backends.stages.text import Postprocessor, Preprocessor\n"
        f"p = StageParams(model_dir={SMOLLM2!r})\n"
        "req = Preprocessor(p).build({'text_input': 'Hi', 'apply_chat_template': [True]})\n"
        "ids = req.prompt_ids\n"
        "Postprocessor(p)\n"
        "print(len(ids), sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    n, loaded = out.stdout.split(maxsplit=1)
    assert int(n) > 5 and loaded.strip() == "[]", out.stdout

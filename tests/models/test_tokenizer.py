"""Chat templates (sandboxed jinja2 with transformers' globals) and incremental detokenization."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import TemplateError
from kiln.models.loader import convert_gguf, default_model_path
from kiln.models.tokenizer import IncrementalDetokenizer, KilnTokenizer

TOOLS_TEMPLATE = (
    "{%- if tools %}{{ bos_token }}Tools: {{ tools | tojson }}\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system must come first') }}{% endif %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}{{ strftime_now('%Y') | length }}"
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wetter für Orte",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]


@pytest.fixture(scope="module")
def tok(kiln_cache):
    model_dir, _ = convert_gguf(default_model_path(), show_progress=False)
    return KilnTokenizer.from_dir(model_dir)


def test_custom_template_with_tools_equals_transformers(tok, default_hf_tokenizer):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Wie ist das Wetter?"}]
    ours = KilnTokenizer(tok.tokenizer, {**tok.config, "chat_template": TOOLS_TEMPLATE})
    expected = default_hf_tokenizer.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, tools=TOOLS,
                                                        tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tools=TOOLS) == expected
    assert "Wetter für Orte" in expected  # tojson keeps unicode, as transformers does


def test_template_raise_exception_is_a_template_error(tok):
    ours = KilnTokenizer(tok.tokenizer, {**tok.config, "chat_template": TOOLS_TEMPLATE})
    with pytest.raises(TemplateError, match="system must come first"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_template_sandbox_blocks_python_internals(tok):
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    evil = KilnTokenizer(tok.tokenizer, {**tok.config, "chat_template": template})
    with pytest.raises(TemplateError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def _stream(tok, ids):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "emoji 🎉🧪 split across byte tokens", "中文 日本語 한국어", "naïve café — 1.5°C", "a\n\n  b\tc"],
)
def test_incremental_detokenizer_equals_full_decode(tok, text):
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_is_held_back_until_complete(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1  # byte-level BPE spells it with several tokens
    deltas = _stream(tok, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and "".join(deltas) == "🎉"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_incremental_detokenizer_property(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in tok.decode(ids)


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory, kiln_cache):
    """A GGUF with a SentencePiece ("llama") vocabulary and no merges, as Llama 2 and Mistral files have."""
    from tiny_models import SPM_TOKENS, make_hf_model, write_gguf

    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return write_gguf(make_hf_model("llama", vocab_size=len(SPM_TOKENS), seed=4), path, tokenizer="llama")


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("the and hello world kiln,.!?' \nXé日ÿ")),
                    max_size=40))
def test_sentencepiece_gguf_tokenizes_as_transformers_does(spm_gguf, text):
    """Pieces merged best score first, the space marker before the text, bytes for what no piece
    covers; BOS added as llama.cpp does; decoding gives the text back."""
    from transformers import AutoTokenizer

    from kiln.models.loader import load_model

    ours, ref = _spm_tokenizers.get(spm_gguf) or _spm_tokenizers.setdefault(spm_gguf, (
        load_model(spm_gguf, show_progress=False).tokenizer,
        AutoTokenizer.from_pretrained(str(spm_gguf.parent), gguf_file=spm_gguf.name)))
    ids = ours.encode(text)
    assert ids == ref(text)["input_ids"]
    assert ids[:1] == [1]  # <s>
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    if text and not text.startswith(" "):
        assert ours.decode(ids, skip_special_tokens=True) == text
    assert "".join(_stream(ours, ids[1:])) == ours.decode(ids[1:], skip_special_tokens=True)


_spm_tokenizers: dict = {}


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o"])
def test_gguf_pre_tokenizers_split_as_transformers_gguf_mapping_does(pre, tmp_path):
    """A byte-level GGUF's `tokenizer.ggml.pre` picks how text is split before merges (Llama 3's,
    Qwen2's, o200k's for gpt-oss): Kiln's split equals the one transformers builds for that name."""
    from tiny_models import make_hf_model, write_gguf
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from kiln.models.gguf_loader import GGUFModel

    ours = GGUFModel(write_gguf(make_hf_model("llama", vocab_size=260), tmp_path / "t.gguf", pre=pre)).tokenizer()
    ref = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for text in ["HELLO there, I'm 12345 tokens; CamelCase WORDs DON'T\n\n  split/paths\r\n", "ÉCOLE été 3.14159 x",
                 "it's   they'LL    end.\n", "日本語のテキスト123 and MixedCASEWord's"]:
        assert ours.pre_tokenizer.pre_tokenize_str(text) == ref.pre_tokenize_str(text), text

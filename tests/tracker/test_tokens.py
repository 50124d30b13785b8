"""Tokenizer + chat template: a real BPE trained locally, the built-in byte-level default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tracker.core.tokens import Tokenizer
from tracker.framework.errors import ChatTemplateError, TokenizationError, TokenizerLoadError

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "KV-cache aware routing sends requests to the replica holding their prefix.",
    "vLLM publishes block events over ZeroMQ; the tracker indexes them in Redis.",
    "Héllo wörld, naïve café — unicode text must survive a round trip.",
]
SPECIALS = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Where is the fox?"},
]


def _train(path: Path) -> Path:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(CORPUS * 5, trainer)
    bos = hf.token_to_id("<s>")
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    path.mkdir(parents=True, exist_ok=True)
    hf.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    tokenizer_json = _train(tmp_path / "tiny-llama")
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA_STYLE,
    }
    (tokenizer_json.parent / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer_json.parent


@pytest.fixture
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_files(model_dir / "tokenizer.json")


def test_chat_ids_are_the_rendered_text_encoded_without_special_tokens(tok: Tokenizer) -> None:
    text = tok.render_chat(MESSAGES)
    assert text.startswith("<s><|start_header_id|>system<|end_header_id|>\n\nYou are terse.")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.chat_token_ids(MESSAGES)
    assert ids == tok.encode(text, add_special_tokens=False)
    # the template's BOS is the only one: chat encoding must not add a second
    assert ids.count(tok.token_to_id("<s>")) == 1


def test_special_tokens_map_to_single_ids(tok: Tokenizer) -> None:
    for special in SPECIALS:
        token_id = tok.token_to_id(special)
        assert token_id is not None
        assert tok.encode(special) == [token_id]
    ids = tok.chat_token_ids(MESSAGES)
    assert ids.count(tok.token_to_id("<|eot_id|>")) == 2
    assert tok.eos_token_id == tok.token_to_id("<|eot_id|>")
    assert not tok.has_fast_encoder


def test_completion_prompt_adds_bos_and_ids_pass_through(tok: Tokenizer) -> None:
    bos = tok.token_to_id("<s>")
    ids = tok.prompt_token_ids("The quick brown fox")
    assert ids[0] == bos
    assert ids[1:] == tok.encode("The quick brown fox")
    assert tok.prompt_token_ids([5, 6, 7]) == [5, 6, 7]
    with pytest.raises(TokenizationError, match="out of vocabulary"):
        tok.prompt_token_ids([tok.vocab_size])
    with pytest.raises(TokenizationError, match="integers"):
        tok.prompt_token_ids([1, "2"])  # type: ignore[list-item]
    with pytest.raises(TokenizationError, match="integers"):
        tok.prompt_token_ids([True])


def test_generation_prompt_is_optional(tok: Tokenizer) -> None:
    with_prompt = tok.chat_token_ids(MESSAGES)
    without = tok.chat_token_ids(MESSAGES, add_generation_prompt=False)
    assert with_prompt[: len(without)] == without
    assert len(with_prompt) > len(without)


def test_text_parts_are_joined_by_newlines_as_vllm_does(tok: Tokenizer) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert tok.render_chat(parts) == tok.render_chat([{"role": "user", "content": "a\nb"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "string or a list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
        ([{"role": "user", "content": [{"type": "text"}]}], "string 'text'"),
        ([{"role": "user", "content": ["raw"]}], "objects"),
        (["not a message"], "object"),
    ],
)
def test_bad_messages_are_rejected_clearly(tok: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(TokenizationError, match=match):
        tok.chat_token_ids(messages)  # type: ignore[arg-type]


def test_template_errors(tok: Tokenizer) -> None:
    hf = tok.hf
    raising = Tokenizer(
        hf, "{{ raise_exception('roles must alternate') }}", name="t", eos_token="</s>"
    )
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        raising.render_chat(MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        Tokenizer(hf, "{% for m in messages %}", name="t")
    # the sandbox is immutable and blocks attribute escapes
    with pytest.raises(ChatTemplateError):
        Tokenizer(hf, "{% set x = [] %}{{ x.append(1) }}", name="t").render_chat(MESSAGES)
    with pytest.raises(ChatTemplateError):
        Tokenizer(hf, "{{ ''.__class__.__mro__ }}", name="t").render_chat(MESSAGES)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(hf, None, name="t").render_chat(MESSAGES)
    assert isinstance(ChatTemplateError("x"), ValueError)


def test_transformers_environment_features(tok: Tokenizer) -> None:
    template = (
        "{% for m in messages %}\n"
        "  {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{% generation %}{{ m['content'] }}{% endgeneration %}\n"
        "{% endfor %}\n"
        "{{ tools | tojson }}|{{ extra }}|{{ strftime_now('%Y') | length }}"
    )
    t = Tokenizer(tok.hf, template, name="t")
    out = t.render_chat(MESSAGES, tools=[{"name": "é"}], extra="kw")
    # trim_blocks/lstrip_blocks drop the block lines; tojson does not escape non-ASCII
    assert out == 'You are terse.[{"name": "é"}]|kw|4'


def test_tool_call_arguments_are_parsed_for_the_template(tok: Tokenizer) -> None:
    template = "{% for m in messages %}{{ m.tool_calls[0].function.arguments.city }}{% endfor %}"
    t = Tokenizer(tok.hf, template, name="t")
    call = {"type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}
    out = t.render_chat(
        [{"role": "assistant", "content": None, "tool_calls": [call]}], add_generation_prompt=False
    )
    assert out == "Oslo"


def test_named_templates_pick_tool_use_when_tools_are_given(tok: Tokenizer) -> None:
    templates = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    t = Tokenizer(tok.hf, templates, name="t")
    assert t.render_chat(MESSAGES) == "D"
    assert t.render_chat(MESSAGES, tools=[{"type": "function"}]) == "T"


def test_loading_variants(model_dir: Path, tmp_path: Path) -> None:
    by_dir = Tokenizer.from_files(model_dir)
    assert by_dir.bos_token == "<s>"
    assert by_dir.render_chat(MESSAGES).startswith("<s>")
    jinja = tmp_path / "plain.jinja"
    jinja.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    explicit = Tokenizer.from_files(model_dir / "tokenizer.json", jinja, eos_token="</s>")
    assert explicit.render_chat(MESSAGES) == "[You are terse.][Where is the fox?]"
    assert explicit.eos_token_id == explicit.token_to_id("</s>")
    (model_dir / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_files(model_dir).render_chat(MESSAGES) == "J2"
    with pytest.raises(TokenizerLoadError):
        Tokenizer.from_files(tmp_path / "missing.json")
    bad_config = tmp_path / "tokenizer_config.json"
    bad_config.write_text("{}")
    with pytest.raises(TokenizerLoadError, match="chat_template"):
        Tokenizer.from_files(model_dir, bad_config)


def test_builtin_round_trips_text_and_knows_chatml() -> None:
    tok = Tokenizer.builtin()
    text = "Héllo, wörld! 🙂 tabs\tand\nnewlines"
    ids = tok.encode(text)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert tok.prompt_token_ids(text) == ids  # no BOS in ChatML
    rendered = tok.render_chat(MESSAGES)
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhere is the fox?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.chat_token_ids(MESSAGES)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>") == 258
    assert tok.decode(ids) == rendered.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert "# Tools" in tok.render_chat(MESSAGES, tools=[{"type": "function"}])


def test_incremental_decoder_holds_back_partial_utf8() -> None:
    tok = Tokenizer.builtin()
    text = "añ🙂b"
    decoder = tok.incremental_decoder()
    pieces = [decoder.push([b]) for b in text.encode()]
    assert "".join(pieces) + decoder.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    truncated = tok.incremental_decoder()
    assert truncated.push(list("🙂".encode())[:2]) == ""
    assert truncated.flush() == "\ufffd"


@given(
    st.lists(
        st.one_of(st.text(max_size=20), st.sampled_from(["<|im_start|>", "<|im_end|>", "<|"])),
        max_size=8,
    )
)
def test_builtin_fast_path_equals_the_hf_pipeline(parts: list[str]) -> None:
    text = "".join(parts)
    tok = _BUILTIN
    assert tok.has_fast_encoder
    assert tok.encode(text) == tok.hf.encode(text, add_special_tokens=False).ids
    assert tok.prompt_token_ids(text) == tok.hf.encode(text, add_special_tokens=True).ids


_BUILTIN = Tokenizer.builtin()

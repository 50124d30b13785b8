"""Segment-cached tokenization equals whole-prompt tokenization, exactly, and stays bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.decide.segments import plan_segments
from router.decide.tokenize import PromptTokenizer
from tests.router.trained_tokenizers import CHATML, CORPUS, LLAMA, trained
from tracker.core.tokens import Tokenizer

SEGMENTED = ["builtin", "chatml-bpe", "llama-bos", "nfkc-prefix-space", "overlapping"]
WHOLE = ["metaspace-first", "lstrip-specials"]
ALL = SEGMENTED + WHOLE


@pytest.fixture(scope="module")
def cached(tokenizers: dict[str, Tokenizer]) -> dict[str, PromptTokenizer]:
    """One PromptTokenizer per tokenizer, shared by all examples so segments are reused."""
    return {name: PromptTokenizer(tok) for name, tok in tokenizers.items()}


@pytest.fixture(scope="module")
def tiny(tokenizers: dict[str, Tokenizer]) -> dict[str, PromptTokenizer]:
    """Caches so small that every example evicts."""
    return {name: PromptTokenizer(tok, cache_tokens=96) for name, tok in tokenizers.items()}


@pytest.fixture(scope="module")
def subjects(
    tokenizers: dict[str, Tokenizer],
    cached: dict[str, PromptTokenizer],
    tiny: dict[str, PromptTokenizer],
) -> dict[str, tuple[Tokenizer, PromptTokenizer, PromptTokenizer]]:
    """Per tokenizer name: (tokenizer, its shared cached tokenizer, its tiny-cache one)."""
    return {name: (tok, cached[name], tiny[name]) for name, tok in tokenizers.items()}


def test_split_is_used_only_where_it_is_exact(cached: dict[str, PromptTokenizer]) -> None:
    for name in SEGMENTED:
        assert cached[name].segmented, (name, cached[name].plan.reason)
        assert cached[name].plan.prefix is not None, (name, cached[name].plan.prompt_reason)
    assert cached["llama-bos"].plan.prefix == (cached["llama-bos"].tokenizer.token_to_id("<s>"),)
    assert "Metaspace" in cached["metaspace-first"].plan.reason
    assert "strips whitespace" in cached["lstrip-specials"].plan.reason
    assert not any(cached[name].segmented for name in WHOLE)


def test_the_tokenizer_itself_encodes_pieces_independently(
    tokenizers: dict[str, Tokenizer],
) -> None:
    """What the segment cache relies on, checked on the library: splitting at added tokens."""
    for name in SEGMENTED:
        tok = tokenizers[name]
        text = tok.render_chat(
            [
                {"role": "system", "content": " Be <|im_end|> brief. "},
                {"role": "user", "content": "x"},
            ]
        )
        plan = plan_segments(tok.hf)
        assert plan.splitter is not None
        pieces = plan.splitter.split(text)
        tokens = plan.splitter.findall(text)
        assert len(pieces) > 3
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            ids += tok.encode(piece)
            if i < len(tokens):
                ids.append(plan.added[tokens[i]])
        assert ids == tok.encode(text), name


def test_metaspace_first_really_is_position_dependent(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["metaspace-first"]
    whole = tok.encode("hello<|im_end|>world")
    pieces = [*tok.encode("hello"), tok.token_to_id("<|im_end|>"), *tok.encode("world")]
    assert whole != pieces  # so the fallback is needed, and taken


SPECIAL_LITERALS = [
    *CHATML,
    *LLAMA,
    *["<|im_start", "im_end|>", "<<|im_end|>>", "<s", "</", "<|im", "t<|", "HeLLo World"],
]
FRAGMENTS = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=12),
    st.sampled_from([" ", "  ", "\n", "\n\n", "\r\n", "\t", " \n ", "\u00a0", "\u3000", ""]),
    st.sampled_from(SPECIAL_LITERALS),
    st.sampled_from(["hello", " world", "Héllo", "漢字", "🙂", "12 345", "café", "'s"]),
)
TEXT = st.lists(FRAGMENTS, max_size=8).map("".join)
SYSTEM_PROMPTS = [CORPUS[0], CORPUS[0] + "\n\n" + CORPUS[3], " You are terse. ", ""]


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        system = draw(st.one_of(st.sampled_from(SYSTEM_PROMPTS), TEXT))
        messages.append({"role": "system", "content": system})
    turns = draw(st.integers(1, 5))
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": draw(TEXT)})
    return messages


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations(), generation=st.booleans())
def test_cached_chat_ids_equal_whole_prompt_ids(
    name: str,
    messages: list[dict[str, Any]],
    generation: bool,
    subjects: dict[str, tuple[Tokenizer, PromptTokenizer, PromptTokenizer]],
) -> None:
    tok, cached, tiny = subjects[name]
    expected = tok.chat_token_ids(messages, add_generation_prompt=generation)
    assert cached.chat_sync(messages, add_generation_prompt=generation) == expected
    # again: now served (partly or wholly) from the cache
    assert cached.chat_sync(messages, add_generation_prompt=generation) == expected
    assert tiny.chat_sync(messages, add_generation_prompt=generation) == expected


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=100, deadline=None)
@given(text=TEXT)
def test_cached_completion_ids_equal_whole_prompt_ids(
    name: str,
    text: str,
    tokenizers: dict[str, Tokenizer],
    cached: dict[str, PromptTokenizer],
) -> None:
    expected = tokenizers[name].prompt_token_ids(text)
    assert cached[name].prompt_sync(text) == expected
    assert cached[name].prompt_sync(text) == expected


def test_repeated_system_prompt_and_history_cost_a_lookup(tokenizers: dict[str, Tokenizer]) -> None:
    pt = PromptTokenizer(tokenizers["chatml-bpe"])
    history = [
        {"role": "system", "content": CORPUS[0] * 20},
        {"role": "user", "content": CORPUS[1] * 10},
        {"role": "assistant", "content": CORPUS[2] * 10},
    ]
    pt.chat_sync(history)
    before = pt.stats
    follow_up = [*history, {"role": "user", "content": "And then?"}]
    assert pt.chat_sync(follow_up) == tokenizers["chatml-bpe"].chat_token_ids(follow_up)
    after = pt.stats
    assert after.misses - before.misses == 1  # only the new turn was tokenized
    assert after.miss_tokens - before.miss_tokens < 10
    assert after.hit_tokens - before.hit_tokens > 500


def test_cache_stays_within_its_bound(tokenizers: dict[str, Tokenizer]) -> None:
    pt = PromptTokenizer(tokenizers["chatml-bpe"], cache_tokens=2_000)
    for i in range(50):
        messages = [{"role": "user", "content": f"{i} " + CORPUS[i % len(CORPUS)] * 3}]
        assert pt.chat_sync(messages) == tokenizers["chatml-bpe"].chat_token_ids(messages)
        assert pt.stats.cached_tokens <= 2_000
    assert pt.stats.evictions > 0
    off = PromptTokenizer(tokenizers["chatml-bpe"], cache_tokens=0)
    assert off.chat_sync(messages) == tokenizers["chatml-bpe"].chat_token_ids(messages)
    assert off.stats.entries == 0


def test_whole_prompt_fallback_is_cached_too(tokenizers: dict[str, Tokenizer]) -> None:
    pt = PromptTokenizer(tokenizers["metaspace-first"])
    messages = [{"role": "user", "content": "hello world"}]
    pt.chat_sync(messages)
    pt.chat_sync(messages)
    assert (pt.stats.misses, pt.stats.hits) == (1, 1)


def test_settings_that_change_ids_disable_the_split(tmp_path: Path) -> None:
    hf = trained(CHATML)
    hf.enable_truncation(64)
    assert "truncation" in plan_segments(hf).reason
    hf = trained(CHATML)
    hf.encode_special_tokens = True
    assert "encode_special_tokens" in plan_segments(hf).reason
    hf = trained([])
    assert "no added tokens" in plan_segments(hf).reason

"""Segment-cached tokenization equals whole-prompt tokenization, exactly, off the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFTokenizer

from router.segments import plan_segments
from router.tokenize import PromptTokenizer
from tracker.core.chat import CHATML_TEMPLATE
from tracker.core.tokens import Tokenizer
from tracker.framework.errors import TokenizationError

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = [
    "You are a helpful assistant. Answer briefly and precisely.",
    "KV-cache aware routing sends a request to the replica that holds its prefix.",
    "The quick brown fox jumps over the lazy dog; 12345 67890!",
    "Héllo wörld, naïve café — ünïcödé text, 漢字かな, emoji 🙂 and tabs\tand\nnewlines.",
    "def route(request):\n    return min(replicas, key=expected_ttft)\n",
]


def _trained(
    specials: list[str],
    *,
    pre: Any = None,
    normalizer: Any = None,
    post: Callable[[HFTokenizer], Any] | None = None,
) -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    if normalizer is not None:
        hf.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(CORPUS * 10, trainer)
    if post is not None:
        hf.post_processor = post(hf)
    return hf


def _bos(hf: HFTokenizer) -> Any:
    return processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", hf.token_to_id("<s>"))]
    )


def _metaspace_first() -> HFTokenizer:
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *CHATML])
    hf.train_from_iterator(CORPUS * 10, trainer)
    return hf


def _overlapping() -> HFTokenizer:
    """Added tokens that overlap the specials: the split must be leftmost-longest like HF's."""
    hf = _trained(CHATML, normalizer=normalizers.Lowercase())
    overlapping = ["<|im", "_end|>", "<|im_start|>user\n", "t<|", "end|>\n<"]
    hf.add_tokens([AddedToken(t, normalized=False) for t in overlapping])
    hf.add_tokens([AddedToken("hello world", normalized=True)])
    return hf


def _lstrip() -> HFTokenizer:
    hf = _trained([])
    hf.add_special_tokens([AddedToken(t, lstrip=True, rstrip=True) for t in CHATML])
    return hf


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    """Real tokenizers trained here, saved to disk and loaded the way a deployment loads them."""
    root = tmp_path_factory.mktemp("tokenizers")
    made = {
        "chatml-bpe": (_trained(CHATML), CHATML_TEMPLATE, "<|im_end|>", None),
        "llama-bos": (_trained(LLAMA, post=_bos), LLAMA_TEMPLATE, "<|eot_id|>", "<s>"),
        "nfkc-prefix-space": (
            _trained(
                CHATML,
                pre=pre_tokenizers.ByteLevel(add_prefix_space=True),
                normalizer=normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
            ),
            CHATML_TEMPLATE,
            "<|im_end|>",
            None,
        ),
        "overlapping": (_overlapping(), CHATML_TEMPLATE, "<|im_end|>", None),
        "metaspace-first": (_metaspace_first(), CHATML_TEMPLATE, "<|im_end|>", None),
        "lstrip-specials": (_lstrip(), CHATML_TEMPLATE, "<|im_end|>", None),
    }
    out = {"builtin": Tokenizer.builtin()}
    for name, (hf, template, eos, bos) in made.items():
        folder = root / name
        folder.mkdir()
        hf.save(str(folder / "tokenizer.json"))
        (folder / "chat_template.jinja").write_text(template)
        out[name] = Tokenizer.from_files(folder, eos_token=eos, bos_token=bos)
    return out


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


class _Recorder:
    """A tokenizers.Tokenizer stand-in that records which threads encode."""

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        self.threads: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> Any:
        self.threads.append(threading.get_ident())
        self.gate.wait(5)
        return self.hf.encode_batch(texts, add_special_tokens=add_special_tokens)


def _recorded(
    tok: Tokenizer, pool: ThreadPoolExecutor, inline_chars: int = 0
) -> tuple[PromptTokenizer, _Recorder]:
    """A prompt tokenizer encoding in ``pool`` (or inline), its encoder recording threads."""
    pt = PromptTokenizer(tok, executor=pool, inline_chars=inline_chars)
    recorder = _Recorder(tok.hf)
    pt._hf = recorder  # type: ignore[assignment]
    return pt, recorder


async def test_async_path_encodes_in_the_executor_and_shares_work(
    tokenizers: dict[str, Tokenizer],
) -> None:
    tok = tokenizers["chatml-bpe"]
    with ThreadPoolExecutor(2) as pool:
        pt, recorder = _recorded(tok, pool)
        conversations = [
            [{"role": "system", "content": CORPUS[0]}, {"role": "user", "content": f"q{i % 3}"}]
            for i in range(12)
        ]
        results = await asyncio.gather(*(pt.chat(m) for m in conversations))
        assert results == [tok.chat_token_ids(m) for m in conversations]
        assert threading.get_ident() not in recorder.threads
        # one batch per distinct user turn; the system prompt was encoded once and shared
        assert len(recorder.threads) == 3
        assert pt.stats.misses == 6  # system, "\n", 3 user turns, "assistant\n"
        assert pt.stats.shared > 0
        assert await pt.prompt("plain <|im_end|> text") == tok.prompt_token_ids(
            "plain <|im_end|> text"
        )
        assert await pt.prompt([1, 2, 3]) == [1, 2, 3]


async def test_short_misses_are_encoded_inline_and_long_ones_in_the_executor(
    tokenizers: dict[str, Tokenizer],
) -> None:
    tok = tokenizers["chatml-bpe"]
    with ThreadPoolExecutor(1) as pool:
        pt, recorder = _recorded(tok, pool, inline_chars=200)
        short = [{"role": "user", "content": "a short question"}]
        assert await pt.chat(short) == tok.chat_token_ids(short)
        assert recorder.threads == [threading.get_ident()]
        long = [{"role": "system", "content": " ".join(CORPUS) * 2}, *short]
        assert await pt.chat(long) == tok.chat_token_ids(long)
        assert len(recorder.threads) == 2 and recorder.threads[1] != threading.get_ident()
    with pytest.raises(ValueError, match="inline_chars"):
        PromptTokenizer(tok, inline_chars=-1)


async def test_a_cancelled_request_does_not_break_others_waiting_on_its_batch(
    tokenizers: dict[str, Tokenizer],
) -> None:
    tok = tokenizers["chatml-bpe"]
    with ThreadPoolExecutor(1) as pool:
        pt, recorder = _recorded(tok, pool)
        recorder.gate.clear()
        messages = [{"role": "user", "content": "shared piece of work"}]
        first = asyncio.create_task(pt.chat(messages))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(pt.chat(messages))
        await asyncio.sleep(0.01)
        first.cancel()
        recorder.gate.set()
        assert await second == tok.chat_token_ids(messages)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(recorder.threads) == 1
        assert pt.chat_sync(messages) == tok.chat_token_ids(messages)
        assert pt.stats.misses == 3  # the turn, "\n" and "assistant\n", each encoded once


async def test_invalid_input_is_a_tokenization_error(tokenizers: dict[str, Tokenizer]) -> None:
    pt = PromptTokenizer(tokenizers["builtin"])
    with pytest.raises(TokenizationError, match="Unicode"):
        await pt.chat([{"role": "user", "content": "bad \ud800 surrogate"}])
    with pytest.raises(TokenizationError, match="out of vocabulary"):
        await pt.prompt([10**9])
    with pytest.raises(ValueError, match="cache_tokens"):
        PromptTokenizer(tokenizers["builtin"], cache_tokens=-1)


def test_whole_prompt_fallback_is_cached_too(tokenizers: dict[str, Tokenizer]) -> None:
    pt = PromptTokenizer(tokenizers["metaspace-first"])
    messages = [{"role": "user", "content": "hello world"}]
    pt.chat_sync(messages)
    pt.chat_sync(messages)
    assert (pt.stats.misses, pt.stats.hits) == (1, 1)


def test_settings_that_change_ids_disable_the_split(tmp_path: Path) -> None:
    hf = _trained(CHATML)
    hf.enable_truncation(64)
    assert "truncation" in plan_segments(hf).reason
    hf = _trained(CHATML)
    hf.encode_special_tokens = True
    assert "encode_special_tokens" in plan_segments(hf).reason
    hf = _trained([])
    assert "no added tokens" in plan_segments(hf).reason

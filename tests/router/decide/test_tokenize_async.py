"""PromptTokenizer off the event loop: executor batches, inline short misses, cancellation."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from router.decide.tokenize import FAST_INLINE_CHARS, INLINE_CHARS, PromptTokenizer
from tests.router.trained_tokenizers import CORPUS
from tracker.core.tokens import Tokenizer
from tracker.framework.errors import TokenizationError


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


class _CountingPool(ThreadPoolExecutor):
    """A thread pool that counts the jobs it is given."""

    def __init__(self) -> None:
        super().__init__(1)
        self.jobs = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


async def test_a_fast_encoder_encodes_a_long_prompt_inline() -> None:
    """The builtin's exact byte encoder costs less than a worker thread's round trip up to
    a ~16k-token prompt; the HF pipeline's threshold stays a question's length."""
    builtin = Tokenizer.builtin()
    with _CountingPool() as pool:
        pt = PromptTokenizer(builtin, executor=pool)
        assert pt.inline_chars == FAST_INLINE_CHARS
        prompt = "lorem ipsum " * 1_200  # 14,400 characters, one token each
        assert await pt.prompt(prompt) == builtin.prompt_token_ids(prompt)
        assert pool.jobs == 0
        longer = prompt * 2
        assert await pt.prompt(longer) == builtin.prompt_token_ids(longer)
        assert pool.jobs == 1


def test_the_hf_pipeline_inlines_only_short_misses(tokenizers: dict[str, Tokenizer]) -> None:
    assert PromptTokenizer(tokenizers["chatml-bpe"]).inline_chars == INLINE_CHARS


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

"""Prompt token ids for routing: tokenization off the event loop, with a cache of segments.

:class:`PromptTokenizer` renders the chat template, splits the text where the tokenizer itself
splits it (:mod:`router.decide.segments`), looks each piece up in a bounded LRU by its hash,
encodes only the misses (in a worker thread, or inline when short) and assembles the ids;
where the split is not provably exact the whole text is one piece. :class:`TokenizerBook`
holds each model's tokenizer and answers a request's token ids. docs/architecture.md
("Router", tokenize) has the costs.
"""

from __future__ import annotations

import asyncio
import operator
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, Final

import xxhash

from router.config import RouterSettings, model_paths
from router.decide.request import PromptRequest
from router.decide.segments import plan_segments, split_pieces
from tracker.core.chat import Message, load_chat_template
from tracker.core.tokens import Tokenizer
from tracker.framework.errors import ConfigError, TokenizationError

_ENTRY_OVERHEAD: Final = 32  # tokens' worth (8 bytes each) of dict entry, key and tuple header
_PIECE_SEED: Final = 0  # a piece encoded without special tokens
_WHOLE_SEED: Final = 1  # a whole prompt encoded with special tokens
# Misses this short are encoded on the event loop: a worker thread's round trip (~0.1 ms, and
# the GIL handed back and forth) costs more than encoding a question-sized piece.
INLINE_CHARS: Final = 1_024
# ... and with a tokenizer's own fast exact encoder (the builtin's: 14k characters in ~0.7 ms
# on the event loop), anything up to this: on a busy host the round trip to a worker thread
# waited for the GIL and the CPU for 14 ms on average (Mooncake trace, ~14k-token prompts).
FAST_INLINE_CHARS: Final = 16_384


Ids = tuple[int, ...]


class _SegmentCache:
    """Bounded LRU of token id tuples by 128-bit content hash; thread-safe."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.evictions = 0
        self._entries: OrderedDict[int, Ids] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> Ids | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
            return ids

    def put(self, items: Iterable[tuple[int, Ids]]) -> None:
        with self._lock:
            for key, ids in items:
                cost = len(ids) + _ENTRY_OVERHEAD
                if cost > self.max_tokens or key in self._entries:
                    continue
                self._entries[key] = ids
                self.tokens += cost
            while self.tokens > self.max_tokens:
                _, old = self._entries.popitem(last=False)
                self.tokens -= len(old) + _ENTRY_OVERHEAD
                self.evictions += 1


@dataclass(frozen=True, slots=True)
class TokenizerStats:
    """Counters of a :class:`PromptTokenizer` (pieces and tokens), for metrics."""

    hits: int
    misses: int
    shared: int
    hit_tokens: int
    miss_tokens: int
    entries: int
    cached_tokens: int
    evictions: int
    segmented: bool


# A request's pieces in order: ids already known, or the cache key of a miss to resolve.
_Parts = list["Ids | int"]


class PromptTokenizer:
    """Engine token ids of chat and completion requests, cached per segment, off the loop.

    The async methods never tokenize on the event loop; the ``*_sync`` twins run in the
    calling thread (benchmarks, tests). Results equal ``tokenizer.chat_token_ids`` and
    ``tokenizer.prompt_token_ids`` exactly.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        cache_tokens: int = RouterSettings.tokenizer_cache_tokens,
        executor: Executor | None = None,
        inline_chars: int | None = None,
    ) -> None:
        """:param cache_tokens: cache bound in token ids (4 bytes each, ~32 per entry extra).
        :param executor: where misses are encoded (default: the loop's default executor).
        :param inline_chars: misses of at most this many characters in all are encoded in the
            calling thread: a worker thread's round trip costs more than encoding them
            (default: :data:`INLINE_CHARS`, or :data:`FAST_INLINE_CHARS` with a fast encoder).
        """
        if cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {cache_tokens}")
        if inline_chars is not None and inline_chars < 0:
            raise ValueError(f"inline_chars must be >= 0, got {inline_chars}")
        self.tokenizer = tokenizer
        self._hf = tokenizer.hf
        # tracker.core.tokens gives some tokenizers (the builtin) a faster exact encoder than the
        # HF pipeline; Tokenizer.encode uses it, and so do we when it is there.
        self._fast = getattr(tokenizer, "_fast_encode", None) is not None
        if inline_chars is None:
            inline_chars = FAST_INLINE_CHARS if self._fast else INLINE_CHARS
        self.inline_chars = inline_chars
        self.plan = plan_segments(self._hf)
        self._added = {i: (i,) for i in self.plan.added.values()}
        # One int object per id (~36 bytes each), shared by every cached piece: a cached token
        # then costs a pointer. Ids past the table (none, normally) keep their own objects.
        vocab = self._hf.get_vocab(with_added_tokens=True)
        self._ints: Ids = tuple(range(max(vocab.values(), default=-1) + 1))
        self._cache = _SegmentCache(cache_tokens)
        self._executor = executor
        self._pending: dict[int, tuple[asyncio.Future[list[Ids]], int]] = {}
        self._hits = self._misses = self._shared = self._hit_tokens = self._miss_tokens = 0

    @property
    def segmented(self) -> bool:
        """True when chat prompts are split and cached per segment."""
        return self.plan.splitter is not None

    @property
    def stats(self) -> TokenizerStats:
        return TokenizerStats(
            hits=self._hits,
            misses=self._misses,
            shared=self._shared,
            hit_tokens=self._hit_tokens,
            miss_tokens=self._miss_tokens,
            entries=len(self._cache),
            cached_tokens=self._cache.tokens,
            evictions=self._cache.evictions,
            segmented=self.segmented,
        )

    # -- public API ------------------------------------------------------------------------

    async def chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """``tokenizer.chat_token_ids(messages, ...)``, from the cache where possible."""
        text = self.tokenizer.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return await self._ids(text, special=False)

    async def prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """``tokenizer.prompt_token_ids(prompt)``: text is encoded, id lists are checked."""
        if not isinstance(prompt, str):
            return self.tokenizer.prompt_token_ids(prompt)
        return await self._ids(prompt, special=True)

    def chat_sync(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """:meth:`chat` in the calling thread."""
        text = self.tokenizer.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return self._ids_sync(text, special=False)

    def prompt_sync(self, prompt: str | Sequence[int]) -> list[int]:
        """:meth:`prompt` in the calling thread."""
        if not isinstance(prompt, str):
            return self.tokenizer.prompt_token_ids(prompt)
        return self._ids_sync(prompt, special=True)

    # -- internals -------------------------------------------------------------------------

    def _lookup(self, text: str, special: bool) -> tuple[_Parts, dict[int, str], bool]:
        """(parts, misses by key, whole): ``whole`` means one piece encoded with specials."""
        whole = special and self.plan.prefix is None
        # A whole prompt is encoded even when empty: the post-processor may add BOS to "".
        pieces: list[str | int] = [text] if whole else split_pieces(text, self.plan)
        seed = _WHOLE_SEED if whole else _PIECE_SEED
        parts: _Parts = []
        misses: dict[int, str] = {}
        for piece in pieces:
            if isinstance(piece, int):
                parts.append(self._added[piece])
                continue
            try:
                key = xxhash.xxh3_128_intdigest(piece.encode(), seed)
            except UnicodeEncodeError:
                raise TokenizationError("prompt text is not valid Unicode") from None
            ids = self._cache.get(key)
            if ids is None:
                parts.append(key)
                misses[key] = piece
            else:
                parts.append(ids)
                self._hits += 1
                self._hit_tokens += len(ids)
        return parts, misses, whole

    def _interned(self, ids: list[int]) -> Ids:
        """``ids`` as a tuple of the shared int objects (8 bytes per cached token, not 36)."""
        if len(ids) < 2:  # itemgetter of one index returns the item, not a tuple
            return tuple(ids)
        try:
            shared: Ids = operator.itemgetter(*ids)(self._ints)
        except IndexError:  # an id past the vocabulary
            return tuple(ids)
        return shared

    def _encode(self, texts: list[str], whole: bool) -> list[Ids]:
        """Encode ``texts`` in one batch (releases the GIL): in a worker thread, or inline when
        short (``inline_chars``)."""
        if self._fast:
            encode = self.tokenizer.encode
            return [self._interned(encode(text, add_special_tokens=whole)) for text in texts]
        batch = getattr(self._hf, "encode_batch_fast", None) or self._hf.encode_batch
        encodings = batch(texts, add_special_tokens=whole)
        return [self._interned(e.ids) for e in encodings]

    def _assemble(
        self, parts: _Parts, resolved: Mapping[int, Ids], special: bool, whole: bool
    ) -> list[int]:
        wrap = special and not whole
        ids: list[int] = list(self.plan.prefix or ()) if wrap else []
        for part in parts:  # copies pointers to existing ints: no object per token
            ids.extend(resolved[part] if isinstance(part, int) else part)
        if wrap:
            ids.extend(self.plan.suffix)
        return ids

    def _record(self, resolved: Mapping[int, Ids]) -> None:
        self._misses += len(resolved)
        self._miss_tokens += sum(len(ids) for ids in resolved.values())
        self._cache.put(resolved.items())

    def _ids_sync(self, text: str, *, special: bool) -> list[int]:
        parts, misses, whole = self._lookup(text, special)
        return self._resolve(parts, misses, special, whole)

    def _resolve(
        self, parts: _Parts, misses: dict[int, str], special: bool, whole: bool
    ) -> list[int]:
        """Encode ``misses`` in the calling thread, cache them, assemble the prompt."""
        resolved: dict[int, Ids] = {}
        if misses:
            resolved = dict(zip(misses, self._encode(list(misses.values()), whole), strict=True))
            self._record(resolved)
        return self._assemble(parts, resolved, special, whole)

    async def _ids(self, text: str, *, special: bool) -> list[int]:
        parts, misses, whole = self._lookup(text, special)
        if not misses:
            return self._assemble(parts, {}, special, whole)
        if sum(map(len, misses.values())) <= self.inline_chars:
            return self._resolve(parts, misses, special, whole)
        waits: dict[int, tuple[asyncio.Future[list[Ids]], int]] = {}
        fresh: dict[int, str] = {}
        for key, piece in misses.items():
            pending = self._pending.get(key)
            if pending is None:
                fresh[key] = piece
            else:  # another request is encoding this piece right now
                waits[key] = pending
                self._shared += 1
        if fresh:
            loop = asyncio.get_running_loop()
            job = loop.run_in_executor(self._executor, self._encode, list(fresh.values()), whole)
            keys = list(fresh)
            for index, key in enumerate(keys):
                waits[key] = self._pending[key] = (job, index)
            job.add_done_callback(partial(self._settle, keys))
        resolved: dict[int, Ids] = {}
        for key, (future, index) in waits.items():
            # shield: a cancelled request must not cancel a batch other requests wait for
            resolved[key] = (await asyncio.shield(future))[index]
        return self._assemble(parts, resolved, special, whole)

    def _settle(self, keys: list[int], job: asyncio.Future[list[Ids]]) -> None:
        """Done callback of one encode batch: cache its results, forget it as pending."""
        for key in keys:
            pending = self._pending.get(key)
            if pending is not None and pending[0] is job:
                del self._pending[key]
        if job.cancelled() or job.exception() is not None:
            return  # awaiting requests see the error; nothing to cache
        self._record(dict(zip(keys, job.result(), strict=True)))


class TokenizerBook:
    """Each model's :class:`PromptTokenizer`: its own if configured, else the default."""

    def __init__(
        self, default: PromptTokenizer, per_model: Mapping[str, PromptTokenizer] | None = None
    ) -> None:
        self.default = default
        self.per_model = dict(per_model or {})

    def for_model(self, model: str) -> PromptTokenizer:
        return self.per_model.get(model, self.default)

    async def token_ids(self, request: PromptRequest, model: str) -> list[int]:
        """The engine's prompt token ids for ``request`` to ``model``.

        :raises TokenizationError: if they cannot be known (no chat template, a content type
            the template rejects).
        """
        if request.token_ids is not None:
            return request.token_ids
        tokenizer = self.for_model(model)
        if request.messages is not None:
            if not tokenizer.tokenizer.has_chat_template:
                raise TokenizationError(f"the tokenizer of {model!r} has no chat template")
            return await tokenizer.chat(
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                tools=request.tools,
                **request.template_kwargs,
            )
        assert request.prompt is not None
        return await tokenizer.prompt(request.prompt)

    @classmethod
    def load(cls, settings: RouterSettings) -> TokenizerBook:
        """Load every configured tokenizer (blocking: reads files).

        :raises ConfigError: a tokenizer or chat template cannot be loaded.
        """
        default_tokenizer, tokenizers = model_paths(settings.tokenizer, "tokenizer")
        default_template, templates = model_paths(settings.chat_template, "chat-template")

        @cache
        def make(path: str | None, template: str | None) -> PromptTokenizer:
            try:
                if path is not None:
                    tokenizer = Tokenizer.from_files(path, template)
                elif template is not None:
                    tokenizer = Tokenizer.builtin(load_chat_template(template))
                else:
                    tokenizer = Tokenizer.builtin()
            except TokenizationError as exc:
                raise ConfigError(str(exc)) from None
            return PromptTokenizer(tokenizer, cache_tokens=settings.tokenizer_cache_tokens)

        default = make(default_tokenizer, default_template)
        per_model = {
            model: make(
                tokenizers.get(model, default_tokenizer), templates.get(model, default_template)
            )
            for model in sorted(set(tokenizers) | set(templates))
        }
        return cls(default, per_model)

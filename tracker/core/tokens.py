"""The engine's token ids for a request: a HuggingFace tokenizer plus its Jinja2 chat template.

Shared by the router (to compute block keys before routing) and the simulated engine (to
compute what it caches), so both see exactly the ids vLLM would: chat requests are rendered to
text with the model's template and encoded with ``add_special_tokens=False``; completion
prompts are encoded with ``add_special_tokens=True`` (or passed through when given as ids).

:meth:`Tokenizer.builtin` needs no download: a byte-level tokenizer (token id = byte value)
with ChatML special tokens and a ChatML template, for tests and the simulated fleet.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import jinja2
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tracker.core.chat import (
    CHATML_TEMPLATE,
    ChatTemplate,
    Message,
    compile_template,
    normalize_messages,
    read_template,
    token_text,
)
from tracker.framework.errors import ChatTemplateError, TokenizationError, TokenizerLoadError

BUILTIN_SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which ``ByteLevel`` pre-tokenization uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


class _ByteEncoder:
    """The builtin tokenizer's encoding without the HF pipeline: ~50x faster on long prompts."""

    def __init__(self, specials: Mapping[str, int]) -> None:
        self._specials = dict(specials)
        self._split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")

    def __call__(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self._specials[part])
            else:
                # slices keep each C call short, so a tokenizing thread lets the GIL go
                for start in range(0, len(part), 1 << 18):
                    ids.extend(part[start : start + (1 << 18)].encode())
        return ids


class Tokenizer:
    """A HuggingFace fast tokenizer with its chat template; thread-safe for concurrent use."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: ChatTemplate | None,
        *,
        name: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        template_vars: Mapping[str, str] | None = None,
    ) -> None:
        """Wrap ``tokenizer``.

        :param chat_template: Jinja source, or HF's list of ``{"name", "template"}`` (the
            ``tool_use`` one is used when tools are given), or None (chat then fails).
        :param bos_token: / :param eos_token: special token strings the template sees.
        :param template_vars: further variables every render sees (e.g. ``pad_token``).
        """
        self.hf = tokenizer
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        if isinstance(chat_template, list):
            named = {t.get("name"): t.get("template") for t in chat_template}
            self._templates = {k: v for k, v in named.items() if isinstance(k, str) and v}
        elif chat_template:
            self._templates = {"default": chat_template}
        else:
            self._templates = {}
        for source in self._templates.values():
            compile_template(source)
        self._vars = {k: v for k, v in (template_vars or {}).items() if v is not None}
        self._fast_encode: Callable[[str], list[int]] | None = None

    @classmethod
    def builtin(cls, chat_template: ChatTemplate | None = None) -> Tokenizer:
        """Byte-level tokenizer (id = byte value) + ChatML tokens; no files.

        :param chat_template: replaces the built-in ChatML template.
        """
        byte_chars = _bytes_to_unicode()
        hf = HFTokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens(list(BUILTIN_SPECIAL_TOKENS))
        tokenizer = cls(
            hf,
            chat_template or CHATML_TEMPLATE,
            name="builtin",
            eos_token="<|im_end|>",
            template_vars={"pad_token": "<|endoftext|>"},
        )
        # no normalizer, no merges, no post-processor: bytes and special tokens are all there is
        tokenizer._fast_encode = _ByteEncoder(
            {t: 256 + i for i, t in enumerate(BUILTIN_SPECIAL_TOKENS)}
        )
        return tokenizer

    @classmethod
    def from_files(
        cls,
        tokenizer_json: str | Path,
        chat_template: str | Path | None = None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> Tokenizer:
        """Load ``tokenizer.json`` (or a directory holding it) and a chat template.

        :param chat_template: a ``.jinja`` file or a tokenizer_config.json with a
            ``chat_template`` key; by default ``chat_template.jinja`` and then
            ``tokenizer_config.json`` next to the tokenizer are tried.
        :param bos_token: / :param eos_token: override tokenizer_config.json's.
        """
        path = Path(tokenizer_json)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust loader raises a bare Exception
            raise TokenizerLoadError(f"cannot load tokenizer {path}: {exc}") from None
        config: dict[str, Any] = {}
        sibling_config = path.parent / "tokenizer_config.json"
        if sibling_config.is_file():
            _, config = read_template(sibling_config)
        template: ChatTemplate | None = None
        if chat_template is not None:
            template, given_config = read_template(Path(chat_template))
            config = {**config, **given_config}
            if template is None:
                raise TokenizerLoadError(f"{chat_template} has no 'chat_template' key")
        elif (path.parent / "chat_template.jinja").is_file():
            template, _ = read_template(path.parent / "chat_template.jinja")
        else:
            template = config.get("chat_template")
        extra = {k: token_text(config.get(k)) for k in ("unk_token", "pad_token")}
        return cls(
            hf,
            template,
            name=str(path.parent.name or path.name),
            bos_token=bos_token or token_text(config.get("bos_token")),
            eos_token=eos_token or token_text(config.get("eos_token")),
            template_vars={k: v for k, v in extra.items() if v is not None},
        )

    @property
    def has_fast_encoder(self) -> bool:
        """Whether :meth:`encode` bypasses the HF pipeline (exactly equal, much faster)."""
        return self._fast_encode is not None

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def token_to_id(self, token: str) -> int | None:
        result: int | None = self.hf.token_to_id(token)
        return result

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (BOS etc.)."""
        if not isinstance(text, str):
            raise TokenizationError("text to encode must be a string")
        if self._fast_encode is not None:
            return self._fast_encode(text)
        ids: list[int] = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary are dropped."""
        text: str = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the chat template renders for ``messages`` (as transformers does)."""
        if not self._templates:
            raise ChatTemplateError(
                f"tokenizer {self.name!r} has no chat template; pass one (e.g. --chat-template)"
            )
        if tools is not None and not isinstance(tools, list):
            raise TokenizationError("tools must be a list")
        source = self._templates.get("tool_use") if tools else None
        source = source or self._templates.get("default") or next(iter(self._templates.values()))
        variables: dict[str, Any] = {
            **self._vars,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **template_kwargs,
            "messages": normalize_messages(messages),
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return compile_template(source).render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from None

    def chat_token_ids(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """vLLM's chat prompt ids: the rendered template encoded without special tokens."""
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """vLLM's completion prompt ids: text encoded with special tokens, or ids checked."""
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise TokenizationError("prompt must be a string or a list of token ids")
        ids: list[int] = []
        for token in prompt:
            if not isinstance(token, int) or isinstance(token, bool):
                raise TokenizationError("prompt token ids must be integers")
            if not 0 <= token < self.vocab_size:
                raise TokenizationError(
                    f"token id {token} is out of vocabulary (size {self.vocab_size})"
                )
            ids.append(token)
        return ids

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.decode)


class IncrementalDecoder:
    """Streams text from ids as they arrive, holding back incomplete UTF-8 (vLLM's offsets)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, ids: Iterable[int]) -> str:
        """Add ``ids``; return the newly completed text (possibly empty)."""
        self._ids.extend(ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (replacement characters included) at the end."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]

"""The tracker's exception tree; foreign errors are translated at the boundary that meets them."""

from __future__ import annotations


class KVRouterError(Exception):
    """Base class for every error kvrouter raises on purpose."""


class DecodeError(KVRouterError):
    """A ZeroMQ frame or msgpack payload is not a valid vLLM/SGLang KV-event message."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class ConfigError(KVRouterError):
    """A setting, flag or replica spec is invalid."""


class IndexUnavailableError(KVRouterError):
    """The index backend (Redis) cannot be reached or failed mid-operation."""


class ReplayError(KVRouterError):
    """A replay request to a publisher's ROUTER socket failed or timed out."""


class FencedError(KVRouterError):
    """This tracker lost its lease: a tracker elected after it writes the index now."""


class TokenizationError(KVRouterError, ValueError):
    """A prompt, message list or token id list cannot be turned into engine token ids."""


class ChatTemplateError(TokenizationError):
    """The chat template is missing, does not compile, or raised while rendering."""


class TokenizerLoadError(TokenizationError):
    """A tokenizer.json, chat template or tokenizer_config.json cannot be read."""

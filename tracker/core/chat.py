"""Chat templates as transformers renders them and messages as vLLM hands them over.

The environment is transformers' (``ImmutableSandboxedEnvironment`` with ``trim_blocks``,
``lstrip_blocks``, loop controls, ``{% generation %}``, ``raise_exception``, a non-escaping
``tojson`` and ``strftime_now``); messages are normalized as vLLM does for templates that
expect string content (text parts joined by newlines, tool-call arguments parsed as JSON).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Final, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tracker.framework.errors import ChatTemplateError, TokenizationError, TokenizerLoadError

CHATML_TEMPLATE: Final = (
    "{% if tools %}<|im_start|>system\n# Tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
Message = Mapping[str, Any]


class _GenerationTags(jinja2.ext.Extension):
    """Accept transformers' ``{% generation %}...{% endgeneration %}`` as a no-op block."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides Jinja's HTML-escaping tojson; templates rely on the plain form.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTags, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from None


def _text_of(content: Any, index: int) -> str | None:
    """A message's content as text: strings as is, text parts joined by newlines (as vLLM)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TokenizationError(f"messages[{index}].content must be a string or a list of parts")
    texts = []
    for part in content:
        if not isinstance(part, Mapping):
            raise TokenizationError(f"messages[{index}].content parts must be objects")
        kind = part.get("type")
        if kind != "text":
            raise TokenizationError(
                f"messages[{index}].content: unsupported part type {kind!r}; "
                "only 'text' parts are supported"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise TokenizationError(f"messages[{index}].content: a text part needs a string 'text'")
        texts.append(text)
    return "\n".join(texts)


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to an HF template: text content, tool-call arguments parsed."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise TokenizationError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizationError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise TokenizationError(f"messages[{i}].role must be a non-empty string")
        item = dict(message)
        item["content"] = _text_of(message.get("content"), i)
        calls = item.get("tool_calls")
        if isinstance(calls, list):
            item["tool_calls"] = [_parse_arguments(call) for call in calls]
        out.append(item)
    return out


def _parse_arguments(call: Any) -> Any:
    """vLLM turns a tool call's JSON ``arguments`` string into an object for the template."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


ChatTemplate = str | list[dict[str, str]]


def load_chat_template(path: str | Path) -> ChatTemplate:
    """A chat template from a ``.jinja`` file or a tokenizer_config.json's ``chat_template``."""
    template, _ = read_template(Path(path))
    if template is None:
        raise TokenizerLoadError(f"{path} has no 'chat_template' key")
    return template


def read_template(path: Path) -> tuple[ChatTemplate | None, dict[str, Any]]:
    """(template, config) from a ``.jinja`` file or a tokenizer_config.json."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenizerLoadError(f"cannot read chat template {path}: {exc}") from None
    if path.suffix != ".json":
        return text, {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object")
    return config.get("chat_template"), config

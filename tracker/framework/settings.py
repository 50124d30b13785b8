"""One source of truth for settings: frozen dataclasses whose fields generate CLI flags and env.

A field declared with :func:`setting` becomes the flag ``--field-name`` and the environment
variable ``KVROUTER_<PART>_<FIELD_NAME>``. Precedence: flag, then environment, then default.
Library code receives the built object and never reads ``os.environ`` itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Self, TypeVar, Union, get_args, get_origin, get_type_hints

from tracker.framework.errors import ConfigError

T = TypeVar("T")

_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*):[^/?#\s]*@")


def redact_url(text: str) -> str:
    """``text`` with the password of every URL in it masked (``redis://:***@host``)."""
    return _URL_PASSWORD.sub(r"\g<head>:***@", text)


def comma_list(spec: str, kind: Callable[[str], T]) -> tuple[T, ...]:
    """The items of a comma-separated setting (``"a, b,"`` -> ``("a", "b")``), each converted
    by ``kind``; blank items are skipped.

    :raises ValueError: ``kind`` refuses an item (a settings class reports it as a
        :class:`~tracker.framework.errors.ConfigError`).
    """
    return tuple(kind(item.strip()) for item in spec.split(",") if item.strip())


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    short: str | None = None,
    choices: Sequence[str] | None = None,
    secret: bool = False,
    positional: bool = False,
) -> Any:
    """Declare a settings field with its help text (and optional explicit flag name).

    A ``positional`` field is a positional argument instead of a flag (a script's input
    file); it is required when ``default`` is ``dataclasses.MISSING``.
    """
    metadata = {"help": help, "flag": flag, "short": short, "choices": choices, "secret": secret}
    metadata["positional"] = positional
    if isinstance(default, tuple | list):
        value = tuple(default)
        return dataclasses.field(default_factory=lambda: value, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _base_type(annotation: Any) -> tuple[type, bool, bool]:
    """(scalar type, optional, repeatable) of a field annotation."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        scalar, _, repeat = _base_type(args[0])
        return scalar, True, repeat
    if origin is tuple:
        return get_args(annotation)[0], False, True
    return annotation, False, False


def _convert(raw: str, kind: type, name: str) -> Any:
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{name}: not a boolean: {raw!r}")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


class Settings:
    """Mixin for frozen dataclasses of settings; subclasses set ``PART``."""

    PART: ClassVar[str] = ""

    @classmethod
    def env_name(cls, name: str) -> str:
        return f"KVROUTER_{cls.PART}_{name}".upper()

    @classmethod
    def _fields(cls) -> list[tuple[dataclasses.Field[Any], type, bool, bool]]:
        hints = get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            kind, optional, repeat = _base_type(hints[f.name])
            out.append((f, kind, optional, repeat))
        return out

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field, defaults left to :meth:`from_args` (env comes between)."""
        for f, kind, _optional, repeat in cls._fields():
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            names = [flag] + ([f.metadata["short"]] if f.metadata.get("short") else [])
            env = cls.env_name(f.name)
            help_text = f"{f.metadata.get('help', '')} [env {env}]"
            if f.metadata.get("positional"):  # required: argparse's own, never from env
                required = f.default is f.default_factory is dataclasses.MISSING
                shown = f.metadata.get("help") if required else help_text
                parser.add_argument(f.name, nargs=None if required else "?", help=shown)
            elif kind is bool and not repeat:
                parser.add_argument(
                    *names,
                    dest=f.name,
                    default=None,
                    action=argparse.BooleanOptionalAction,
                    help=help_text,
                )
            elif repeat:
                parser.add_argument(
                    *names, dest=f.name, action="append", default=None, help=help_text
                )
            else:
                parser.add_argument(
                    *names,
                    dest=f.name,
                    default=None,
                    help=help_text,
                    choices=f.metadata.get("choices"),
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> Self:
        """Build from environment variables (and explicit overrides, which win)."""
        values: dict[str, Any] = {}
        for f, kind, _optional, repeat in cls._fields():
            if f.name in overrides and overrides[f.name] is not None:
                raw: Any = overrides[f.name]
            elif cls.env_name(f.name) in environ:
                raw = environ[cls.env_name(f.name)]
                if repeat:
                    raw = [part for part in raw.replace(";", " ").split() if part]
            else:
                continue
            if repeat:
                items = raw if isinstance(raw, list | tuple) else [raw]
                values[f.name] = tuple(
                    _convert(i, kind, f.name) if isinstance(i, str) else i for i in items
                )
            elif isinstance(raw, str):
                values[f.name] = _convert(raw, kind, f.name)
            else:
                values[f.name] = raw
            choices = f.metadata.get("choices")
            if choices and values[f.name] not in choices:
                raise ConfigError(f"{f.name}: {values[f.name]!r} is not one of {choices}")
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> Self:
        return cls.from_env(environ, **{k: v for k, v in vars(args).items() if v is not None})

    def describe(self) -> dict[str, Any]:
        """Settings for logs, with secrets and URL passwords masked."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata.get("secret") and value:
                value = "***"
            elif isinstance(value, str):
                value = redact_url(value)
            elif isinstance(value, tuple):
                value = tuple(redact_url(v) if isinstance(v, str) else v for v in value)
            out[f.name] = value
        return out

"""Settings: one declaration yields flags and env vars; flag > env > default; typed errors."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

import pytest

from tracker.core.replicas import ReplicaSpec
from tracker.framework.errors import ConfigError
from tracker.framework.settings import Settings, comma_list, setting
from tracker.ingest.config import LookupSettings, TrackerSettings


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoSettings(Settings):
    """Every kind of field the mechanism supports, independent of the real commands."""

    PART = "DEMO"

    name: str = setting("n", "a string")
    count: int = setting(3, "an int")
    ratio: float = setting(0.5, "a float")
    enabled: bool = setting(False, "a bool")
    optional: int | None = setting(None, "an optional int")
    mode: str = setting("a", "a choice", choices=("a", "b"))
    item: tuple[str, ...] = setting(("x",), "repeatable")
    password: str | None = setting(None, "a secret", secret=True)
    renamed: str = setting("r", "explicit flag", flag="--other-name", short="-o")


def build(cls: type[Settings], argv: list[str], environ: Mapping[str, str]) -> Settings:
    parser = argparse.ArgumentParser()
    cls.add_arguments(parser)
    return cls.from_args(parser.parse_args(argv), environ)


def test_defaults() -> None:
    demo = DemoSettings.from_env({})
    assert (demo.name, demo.count, demo.ratio, demo.enabled) == ("n", 3, 0.5, False)
    assert (demo.optional, demo.mode, demo.item, demo.password) == (None, "a", ("x",), None)
    tracker = TrackerSettings.from_env({})
    assert tracker.block_size == 16
    assert tracker.replica == ()
    assert tracker.discover is True
    assert tracker.redis is None


def test_env_values_are_typed() -> None:
    demo = DemoSettings.from_env(
        {
            "KVROUTER_DEMO_NAME": "env",
            "KVROUTER_DEMO_COUNT": "7",
            "KVROUTER_DEMO_RATIO": "1.25",
            "KVROUTER_DEMO_ENABLED": "yes",
            "KVROUTER_DEMO_OPTIONAL": "9",
            "KVROUTER_DEMO_MODE": "b",
            "KVROUTER_DEMO_ITEM": "p q",
        }
    )
    assert (demo.name, demo.count, demo.ratio, demo.enabled) == ("env", 7, 1.25, True)
    assert (demo.optional, demo.mode, demo.item) == (9, "b", ("p", "q"))


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("true", True),
        ("ON", True),
        (" yes ", True),
        ("0", False),
        ("off", False),
        ("No", False),
        ("", False),
    ],
)
def test_env_booleans(raw: str, value: bool) -> None:
    assert DemoSettings.from_env({"KVROUTER_DEMO_ENABLED": raw}).enabled is value


def test_precedence_flag_then_env_then_default() -> None:
    environ = {"KVROUTER_TRACKER_BLOCK_SIZE": "32", "KVROUTER_TRACKER_MODEL": "env-model"}
    settings = build(TrackerSettings, ["--block-size", "64"], environ)
    assert isinstance(settings, TrackerSettings)
    assert settings.block_size == 64  # flag beats env
    assert settings.model == "env-model"  # env beats default
    assert settings.topic == ""  # default
    assert build(TrackerSettings, [], environ).block_size == 32


def test_bool_flags_both_ways_beat_env() -> None:
    environ = {"KVROUTER_TRACKER_DISCOVER": "false"}
    assert build(TrackerSettings, [], environ).discover is False  # type: ignore[attr-defined]
    assert build(TrackerSettings, ["--discover"], environ).discover is True  # type: ignore[attr-defined]
    assert build(TrackerSettings, ["--no-discover"], {}).discover is False  # type: ignore[attr-defined]


def test_repeatable_replica_flag() -> None:
    argv = ["--replica", "r1=tcp://h:5557", "--replica", "r2=tcp://h:5558,url=http://h:8000"]
    environ = {"KVROUTER_TRACKER_REPLICA": "r9=tcp://x:1"}
    settings = build(TrackerSettings, argv, environ)
    assert isinstance(settings, TrackerSettings)
    assert settings.replica == ("r1=tcp://h:5557", "r2=tcp://h:5558,url=http://h:8000")
    assert settings.replica_specs == [
        ReplicaSpec("r1", "tcp://h:5557"),
        ReplicaSpec("r2", "tcp://h:5558", url="http://h:8000"),
    ]


@pytest.mark.parametrize(
    "raw",
    [
        "r1=tcp://a:1 r2=tcp://b:2,replay=tcp://b:3 r3=tcp://c:4",
        "r1=tcp://a:1;r2=tcp://b:2,replay=tcp://b:3;r3=tcp://c:4",
        " r1=tcp://a:1 ;\n r2=tcp://b:2,replay=tcp://b:3;;  r3=tcp://c:4; ",
    ],
)
def test_replicas_from_env(raw: str) -> None:
    settings = TrackerSettings.from_env({"KVROUTER_TRACKER_REPLICA": raw})
    assert [s.id for s in settings.replica_specs] == ["r1", "r2", "r3"]
    assert settings.replica_specs[1].replay == "tcp://b:3"


@pytest.mark.parametrize(
    ("cls", "environ"),
    [
        (TrackerSettings, {"KVROUTER_TRACKER_BLOCK_SIZE": "sixteen"}),
        (TrackerSettings, {"KVROUTER_TRACKER_BLOCK_SIZE": "1.5"}),
        (TrackerSettings, {"KVROUTER_TRACKER_BLOCK_SIZE": "0"}),
        (TrackerSettings, {"KVROUTER_TRACKER_HTTP_PORT": ""}),
        (TrackerSettings, {"KVROUTER_TRACKER_REPLAY_TIMEOUT_S": "soon"}),
        (TrackerSettings, {"KVROUTER_TRACKER_DISCOVER": "maybe"}),
        (TrackerSettings, {"KVROUTER_TRACKER_LOG_LEVEL": "loud"}),
        (TrackerSettings, {"KVROUTER_TRACKER_REPLICA": "r1=tcp://a:1 broken"}),
        (LookupSettings, {"KVROUTER_LOOKUP_BLOCK_SIZE": "x"}),
        (DemoSettings, {"KVROUTER_DEMO_OPTIONAL": "none"}),
        (DemoSettings, {"KVROUTER_DEMO_MODE": "c"}),
    ],
)
def test_bad_env_values_are_config_errors(cls: type[Settings], environ: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        cls.from_env(environ)


@pytest.mark.parametrize(
    "argv",
    [
        ["--block-size", "big"],
        ["--block-size", "-1"],
        ["--replica", "no-equals-sign"],
        ["--replica", "r1=tcp://h:1", "--replica", "r2=tcp://h"],
    ],
)
def test_bad_flag_values_are_config_errors(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        build(TrackerSettings, argv, {})


def test_bad_choice_flag_is_rejected_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build(TrackerSettings, ["--log-level", "loud"], {})
    assert "invalid choice" in capsys.readouterr().err


def test_every_field_has_a_flag_and_an_env_var() -> None:
    for cls in (TrackerSettings, LookupSettings, DemoSettings):
        parser = argparse.ArgumentParser()
        cls.add_arguments(parser)
        options = {a.dest: a for a in parser._actions}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            action = options[f.name]
            env = cls.env_name(f.name)
            assert env == f"KVROUTER_{cls.PART}_{f.name.upper()}"
            assert env in (action.help or "")
            if f.metadata.get("flag") is None:
                assert "--" + f.name.replace("_", "-") in action.option_strings


def test_explicit_flag_and_short_option() -> None:
    assert build(DemoSettings, ["--other-name", "v"], {}).renamed == "v"  # type: ignore[attr-defined]
    assert build(DemoSettings, ["-o", "w"], {}).renamed == "w"  # type: ignore[attr-defined]
    repeated = build(DemoSettings, ["--item", "a", "--item", "b"], {"KVROUTER_DEMO_ITEM": "z"})
    assert repeated.item == ("a", "b")  # type: ignore[attr-defined]


def test_overrides_win_and_none_overrides_are_ignored() -> None:
    demo = DemoSettings.from_env({"KVROUTER_DEMO_COUNT": "4"}, count=None, name="o")
    assert (demo.count, demo.name) == (4, "o")


def test_real_environment_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTER_TRACKER_MODEL", "from-os-environ")
    assert TrackerSettings.from_env({}).model == "default"


def test_settings_are_frozen_and_describe_masks_secrets() -> None:
    demo = DemoSettings.from_env({"KVROUTER_DEMO_PASSWORD": "hunter2"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        demo.name = "x"  # type: ignore[misc]
    described = demo.describe()
    assert described["password"] == "***"
    assert described["count"] == 3
    assert DemoSettings.from_env({}).describe()["password"] is None


def test_comma_list_converts_each_item_and_skips_blank_ones() -> None:
    assert comma_list(" a, b,,c ", str) == ("a", "b", "c")
    assert comma_list("100, 200.5", float) == (100.0, 200.5)
    assert comma_list("", int) == ()
    with pytest.raises(ValueError, match="invalid literal"):
        comma_list("8,x", int)

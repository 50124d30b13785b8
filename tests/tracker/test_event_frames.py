"""Codec tests: live message frames and replay replies, in each layout vLLM has sent."""

from __future__ import annotations

import pytest

from tracker.core.events import (
    REPLAY_END_SEQ,
    Message,
    decode_message,
    decode_replay_reply,
    encode_message,
)
from tracker.framework.errors import DecodeError

END = b"\xff" * 8
SEQ7 = (7).to_bytes(8, "big")

# ------------------------------------------------------------------ frames


def test_live_message_round_trip() -> None:
    frames = encode_message(b"kv-events", 258, b"payload")
    assert frames == [b"kv-events", b"\x00" * 6 + b"\x01\x02", b"payload"]
    assert decode_message(frames) == Message(b"kv-events", 258, b"payload")
    assert decode_message([memoryview(b""), SEQ7, bytearray(b"p")]) == Message(b"", 7, b"p")


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([SEQ7, b"p"], id="2-frames"),
        pytest.param([b"", b"t", SEQ7, b"p"], id="4-frames"),
        pytest.param([], id="no-frames"),
        pytest.param([b"t", b"\x00" * 7, b"p"], id="seq-7-bytes"),
        pytest.param([b"t", b"\x00" * 9, b"p"], id="seq-9-bytes"),
    ],
)
def test_bad_live_frames(frames: list[bytes]) -> None:
    with pytest.raises(DecodeError) as info:
        decode_message(frames)
    assert info.value.reason == "bad_frames"


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        pytest.param([SEQ7, b"p"], Message(b"", 7, b"p"), id="old-layout-req"),
        pytest.param([b"", SEQ7, b"p"], Message(b"", 7, b"p"), id="old-layout-dealer"),
        pytest.param([b"kv", SEQ7, b"p"], Message(b"kv", 7, b"p"), id="new-layout-req"),
        pytest.param([b"", b"kv", SEQ7, b"p"], Message(b"kv", 7, b"p"), id="new-layout-dealer"),
        pytest.param([b"", b"", SEQ7, b"p"], Message(b"", 7, b"p"), id="new-dealer-empty-topic"),
        pytest.param([END, b""], None, id="end-old-req"),
        pytest.param([b"", END, b""], None, id="end-old-dealer-or-new-req"),
        pytest.param([b"", b"", END, b""], None, id="end-new-dealer"),
        pytest.param([b"kv", END, b""], None, id="end-new-req-with-topic"),
        pytest.param([SEQ7, b""], None, id="end-empty-payload"),
    ],
)
def test_replay_replies(frames: list[bytes], expected: Message | None) -> None:
    assert decode_replay_reply(frames) == expected
    assert int.from_bytes(END, "big") == REPLAY_END_SEQ


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"p"], id="1-frame"),
        pytest.param([b"", b"", b"", SEQ7, b"p"], id="5-frames"),
        pytest.param([b"x", b"kv", SEQ7, b"p"], id="4-frames-without-delimiter"),
        pytest.param([b"\x00" * 7, b"p"], id="seq-7-bytes"),
        pytest.param([b"", b"kv", b"\x00" * 9, b"p"], id="dealer-seq-9-bytes"),
    ],
)
def test_bad_replay_replies(frames: list[bytes]) -> None:
    with pytest.raises(DecodeError) as info:
        decode_replay_reply(frames)
    assert info.value.reason == "bad_replay"

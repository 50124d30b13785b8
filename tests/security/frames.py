"""Adversarial ZeroMQ messages for the tracker: junk, mangled golden payloads and valid batches.

:class:`FrameSource` is deterministic for a seed. Each message is a list of frames as a
subscriber receives it (``[topic, seq, payload]`` when well framed) and carries the name of
the generator that made it, so a test can check that every kind both reaches the decoder and
gets rejected or accepted. Whether a message is valid is never decided here: the tracker's
own decoder decides, and the tests compare its verdicts with what the index did.
"""

from __future__ import annotations

import datetime
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tracker.core.event_codec import WireEra, encode_batch
from tracker.core.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch

BLOCK_SIZE = 16
_pack = msgspec.msgpack.Encoder().encode
_INTS = (0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 16, 17, -16)
_FLOATS = (0.0, -0.0, 1.5, 1e308, float("inf"), float("-inf"), float("nan"))
_STRINGS = ("", "BlockStored", "BlockRemoved", "AllBlocksCleared", "blockstored", "GPU", "CPU")
_TAGS = ("", "Block", "BlockStoredV2", "KVCacheCleared", "\x00", "\U0001f600" * 40, "x" * 4096)
# msgpack headers that announce far more data than follows (arrays, maps, strings, binaries)
_HUGE_HEADERS = (
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xdc\xff\xff",
    b"\xc9\xff\xff\xff\xff\x01",
)
_MSGPACK_BYTES = (0xC0, 0xC2, 0xC3, 0x90, 0x80, 0xA0, 0xDD, 0xDF, 0xCF, 0xD3, 0xCB, 0xC4, 0xD4)


@dataclass(frozen=True, slots=True)
class Golden:
    """One payload of ``../shared/vectors``: its bytes and the msgpack tree they decode to."""

    name: str
    payload: bytes
    tree: Any


def load_golden(vectors: Path) -> list[Golden]:
    out = []
    for path in sorted(vectors.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            case = json.loads(line)
            payload = bytes.fromhex(case["payload_hex"])
            tree = msgspec.msgpack.decode(payload)
            out.append(Golden(f"{case['tag']}/{case['name']}", payload, tree))
    return out


class FrameSource:
    """Messages of every kind, mixed by weight; deterministic for ``seed``.

    Args:
        golden: the golden payloads to truncate and mutate.
        seed: the random seed (report it when a test fails).
        replicas: well-framed messages go to one of these topics, each with its own sequence.
    """

    def __init__(self, golden: list[Golden], seed: int, replicas: int = 1) -> None:
        self.golden = golden
        self.rng = random.Random(seed)
        self.replicas = [f"fuzz-{i}".encode() for i in range(replicas)]
        self.seqs = dict.fromkeys(self.replicas, 0)
        self._held: list[int] = []  # engine hashes stored by synthesized batches
        self._recent: list[bytes] = []  # synthesized valid payloads, to be mutated too
        self._kinds: list[tuple[str, Callable[[], bytes]]] = [
            ("random_bytes", self.random_bytes),
            ("truncated", self.truncated),
            ("mutated", self.mutated),
            ("wrong_types", self.wrong_types),
            ("unknown_tags", self.unknown_tags),
            ("huge", self.huge),
            ("deep", self.deep),
            ("hashes", self.hashes),
            ("golden", self.golden_payload),
            ("valid", self.valid),
        ]
        self._weights = [12, 10, 20, 16, 5, 3, 2, 6, 6, 20]

    # ---------------------------------------------------------------- messages

    def exhaustive(self) -> Iterator[tuple[str, list[bytes]]]:
        """Every truncation of every golden payload, and each one whole."""
        for golden in self.golden:
            for end in range(len(golden.payload)):
                yield "truncated", self.frame(golden.payload[:end])
            yield "golden", self.frame(golden.payload)

    def messages(self, count: int) -> Iterator[tuple[str, list[bytes]]]:
        """``count`` messages: 3 % mis-framed, the rest well framed with a payload kind."""
        rng = self.rng
        for _ in range(count):
            if rng.random() < 0.03:
                yield "bad_frames", self.bad_frames()
                continue
            kind, make = rng.choices(self._kinds, self._weights)[0]
            yield kind, self.frame(make())

    def frame(self, payload: bytes) -> list[bytes]:
        """``[topic, seq, payload]`` for a random replica, with that replica's next seq."""
        topic = self.rng.choice(self.replicas)
        seq = self.seqs[topic]
        self.seqs[topic] = seq + 1
        return [topic, seq.to_bytes(8, "big"), payload]

    def bad_frames(self) -> list[bytes]:
        rng = self.rng
        payload = rng.choice(self.golden).payload
        topic = rng.choice(self.replicas)
        seq = rng.randbytes(rng.choice((0, 1, 7, 9, 16)))
        return rng.choice(
            (
                [payload],
                [topic, payload],
                [topic, seq, payload],
                [topic, (0).to_bytes(8, "big"), payload, payload],
                [topic, b"", b"", b"", b""],
            )
        )

    # ---------------------------------------------------------------- payload kinds

    def random_bytes(self) -> bytes:
        rng = self.rng
        size = rng.choice((0, 1, 2, 3, 8, rng.randrange(300)))
        data = rng.randbytes(size)
        if size and rng.random() < 0.5:  # start like a batch so the decoder gets further
            data = bytes((rng.choice((0x92, 0x93, 0x94, 0xDC)),)) + data
        return data

    def truncated(self) -> bytes:
        payload = self._source()
        return payload[: self.rng.randrange(len(payload))]

    def mutated(self) -> bytes:
        rng = self.rng
        data = bytearray(self._source())
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data)) if data else 0
            op = rng.randrange(6)
            if op == 0 and data:
                data[at] = rng.randrange(256)
            elif op == 1 and data:
                data[at] ^= 1 << rng.randrange(8)
            elif op == 2:
                data[at:at] = bytes((rng.choice(_MSGPACK_BYTES),))
            elif op == 3 and data:
                del data[at : at + rng.randint(1, 8)]
            elif op == 4 and data:
                end = min(len(data), at + rng.randint(1, 32))
                data[at:at] = data[at:end]
            elif data:
                data[at] = rng.choice(_MSGPACK_BYTES)
        return bytes(data)

    def wrong_types(self) -> bytes:
        """A golden batch with one node (anywhere in its tree) replaced by a value of junk."""
        tree = msgspec.msgpack.decode(self.rng.choice(self.golden).payload)
        return _pack(self._replace_node(tree, self._junk))

    def unknown_tags(self) -> bytes:
        rng = self.rng
        tree = msgspec.msgpack.decode(rng.choice(self.golden).payload)
        for event in tree[1]:
            if rng.random() < 0.7:
                tag = rng.choice(_TAGS)
                if isinstance(event, dict):
                    event["type"] = tag
                else:
                    event[0] = tag
        if rng.random() < 0.3:
            tree[1] = tree[1] * rng.randint(2, 100)
        return _pack(tree)

    def huge(self) -> bytes:
        rng = self.rng
        choice = rng.randrange(5)
        if choice == 0:  # a length header promising gigabytes
            return bytes((0x93,)) + _pack(1.0) + rng.choice(_HUGE_HEADERS) + rng.randbytes(8)
        # sizes stay moderate: decoding is linear, and the fuzz must run in seconds
        if choice == 1:  # many events
            event = rng.choice(("AllBlocksCleared", "Unknown", 7))
            return _pack([1.0, [[event]] * rng.randint(100, 2000), 0])
        if choice == 2:  # a long token list that does not match the hash count
            stored = ["BlockStored", [1], None, [7] * rng.randint(10_000, 50_000), BLOCK_SIZE]
            return _pack([1.0, [stored], 0])
        if choice == 3:  # a long hash list with the right token count, all out of range
            n = rng.randint(100, 2000)
            hashes: list[Any] = [rng.choice((1.5, "h", None, b""))] * n
            return _pack([1.0, [["BlockStored", hashes, None, [1] * (n * BLOCK_SIZE), 16]], 0])
        return _pack([1.0, [["BlockRemoved", [rng.randrange(2**64)] * rng.randint(100, 2000)]]])

    def deep(self) -> bytes:
        rng = self.rng
        depth = rng.choice((64, 512, 2000, 20_000))
        opener = rng.choice((b"\x91", b"\x81\xa1k", b"\x92\xc0"))
        inner = opener * depth + b"\xc0"
        if rng.random() < 0.5:
            return inner
        return b"\x93\xcb" + _pack(1.0)[1:] + b"\x91" + inner + b"\xc0"

    def hashes(self) -> bytes:
        """A stored or removed event whose hashes are of the wrong type or range."""
        rng = self.rng
        value: Any = rng.choice(
            (
                -1,
                -(2**63),
                2**64 - 1,
                1.0,
                True,
                None,
                "123",
                b"",
                b"\x01",
                b"\xff" * 1000,
                [1],
                {"h": 1},
                msgspec.msgpack.Ext(1, b"12345678"),
            )
        )
        if rng.random() < 0.5:
            event: list[Any] = ["BlockRemoved", [value], "GPU"]
        else:
            parent = value if rng.random() < 0.5 else None
            hashes = [value] if parent is None else [rng.randrange(2**64)]
            event = ["BlockStored", hashes, parent, list(range(BLOCK_SIZE)), BLOCK_SIZE, None]
        return _pack([1.0, [event], 0])

    def golden_payload(self) -> bytes:
        return self.rng.choice(self.golden).payload

    def valid(self) -> bytes:
        """A batch built to be valid: a chain of stores, removals, now and then a clear."""
        rng = self.rng
        events: list[Event] = []
        for _ in range(rng.randint(1, 4)):
            roll = rng.random()
            if roll < 0.6 or not self._held:
                events.append(self._stored())
            elif roll < 0.97:
                count = min(len(self._held), rng.randint(1, 3))
                removed: list[int | bytes] = list(rng.sample(self._held, count))
                medium = rng.choice(("GPU", None, "CPU"))
                events.append(BlockRemoved(block_hashes=removed, medium=medium))
            else:
                events.append(AllBlocksCleared())
                self._held.clear()
        era = rng.choice(list(WireEra))
        payload = encode_batch(EventBatch(rng.random() * 2e9, events, 0), era)
        self._recent = [*self._recent[-63:], payload]
        return payload

    # ---------------------------------------------------------------- helpers

    def _source(self) -> bytes:
        if self._recent and self.rng.random() < 0.3:
            return self.rng.choice(self._recent)
        return self.rng.choice(self.golden).payload

    def _stored(self) -> BlockStored:
        rng = self.rng
        blocks = rng.randint(1, 4)
        hashes: list[int | bytes] = [rng.randrange(2**64) for _ in range(blocks)]
        if rng.random() < 0.1:
            hashes = [rng.randbytes(32) for _ in range(blocks)]
        parent = rng.choice(self._held) if self._held and rng.random() < 0.6 else None
        self._held.extend(h for h in hashes if isinstance(h, int))
        extra: list[Any] | None = None
        if rng.random() < 0.1:
            extra = [["salt"]] + [None] * (blocks - 1)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=[rng.randrange(50_000) for _ in range(blocks * BLOCK_SIZE)],
            block_size=BLOCK_SIZE,
            medium=rng.choice(("GPU", "GPU", "CPU", None)),
            lora_name=rng.choice((None, None, None, "adapter")),
            extra_keys=extra,
            group_idx=rng.choice((None, None, 0, 1)),
        )

    def _junk(self, depth: int = 0) -> Any:
        rng = self.rng
        choice = rng.randrange(13 if depth < 3 else 8)
        if choice == 0:
            return None
        if choice == 1:
            return rng.choice((True, False))
        if choice == 2:
            return rng.choice(_INTS)
        if choice == 3:
            return rng.choice(_FLOATS)
        if choice == 4:
            return rng.choice(_STRINGS + _TAGS)
        if choice == 5:
            return rng.randbytes(rng.choice((0, 1, 8, 9, 64)))
        if choice == 6:
            return msgspec.msgpack.Ext(rng.randrange(-128, 128), rng.randbytes(rng.randrange(9)))
        if choice == 7:
            return datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
        if choice == 8:
            return [self._junk(depth + 1) for _ in range(rng.randrange(5))]
        if choice == 9:
            return {self._key(): self._junk(depth + 1) for _ in range(rng.randrange(4))}
        if choice == 10:
            return [rng.choice(_INTS)] * rng.choice((16, 100, 5000))
        if choice == 11:
            nested: Any = None
            for _ in range(rng.choice((10, 100, 400))):
                nested = [nested]
            return nested
        return {"type": rng.choice(_TAGS + _STRINGS), "block_hashes": self._junk(depth + 1)}

    def _key(self) -> Any:
        return self.rng.choice(("type", "block_hashes", "token_ids", 1, b"k", None, 1.5))

    def _replace_node(self, tree: Any, junk: Callable[[], Any]) -> Any:
        slots: list[tuple[Any, Any]] = []

        def collect(node: Any) -> None:
            if isinstance(node, list):
                for i, child in enumerate(node):
                    slots.append((node, i))
                    collect(child)
            elif isinstance(node, dict):
                for key, child in node.items():
                    slots.append((node, key))
                    collect(child)

        collect(tree)
        if not slots or self.rng.random() < 0.05:
            return junk()
        parent, key = self.rng.choice(slots)
        parent[key] = junk()
        return tree

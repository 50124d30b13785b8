"""The ZeroMQ publisher against real sockets: live frames, replay layouts, REQ and DEALER."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from publishers.zmq import ZmqEventPublisher, as_emitted, binds, endpoint_for_rank
from tests.procs import free_port
from tracker.core.event_codec import WireEra, decode_batch, encode_batch
from tracker.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    decode_message,
    decode_replay_reply,
)

TIMEOUT_MS = 2000


def events(i: int) -> list[Event]:
    return [
        BlockStored(
            block_hashes=[(1 << 63) + i, 7],
            parent_block_hash=None if i == 0 else i,
            token_ids=list(range(8)),
            block_size=4,
            medium="GPU",
            extra_keys=[None, None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemoved(block_hashes=[i], medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ]


Socket = zmq.Socket[bytes]


class Sockets:
    """Client sockets of one test, all closed (linger 0) when it ends."""

    def __init__(self) -> None:
        self.context: zmq.Context[Socket] = zmq.Context()
        self.open: list[Socket] = []

    def __call__(self, kind: int) -> Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        self.open.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.open:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def ctx() -> Iterator[Sockets]:
    sockets = Sockets()
    yield sockets
    sockets.close()


def make(**kwargs: Any) -> ZmqEventPublisher:
    kwargs.setdefault("endpoint", "tcp://127.0.0.1:*")
    return ZmqEventPublisher(**kwargs)


def subscribe(ctx: Sockets, endpoint: str) -> Socket:
    sub = ctx(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.2)  # let the subscription reach the publisher (slow joiner)
    return sub


def wait_sent(publisher: ZmqEventPublisher, count: int) -> None:
    deadline = time.monotonic() + 2
    while publisher.next_seq < count:
        assert time.monotonic() < deadline, "publisher thread did not send"
        time.sleep(0.001)


def replay(sock: Socket, start: int, *, dealer: bool = True) -> list[list[bytes]]:
    sock.send_multipart([b"", start.to_bytes(8, "big")] if dealer else [start.to_bytes(8, "big")])
    replies = []
    while True:
        frames = sock.recv_multipart()
        replies.append(frames)
        if decode_replay_reply(frames) is None:
            return replies


@pytest.mark.parametrize("era", [WireEra.V0_22_0, WireEra.V0_24_0])
def test_live_messages_decode_to_what_was_published(ctx: Sockets, era: WireEra) -> None:
    with make(era=era, topic=b"kv", data_parallel_rank=0) as publisher:
        sub = subscribe(ctx, publisher.endpoint)
        before = time.time()
        for i in range(3):
            publisher.publish(events(i))
        for i in range(3):
            frames = sub.recv_multipart()
            assert len(frames) == 3
            message = decode_message(frames)
            assert (message.topic, message.seq) == (b"kv", i)
            batch = decode_batch(message.payload)
            assert batch.events == events(i)
            assert batch.data_parallel_rank == 0
            assert before <= batch.ts <= time.time()
        raw = frames[2]
        # array era: events are arrays (0x9c = 12-element BlockStored); map era: fixmaps
        assert raw[11] == (0x9C if era is WireEra.V0_22_0 else 0x8B)


@pytest.mark.parametrize("layout", ["legacy", "topic"])
def test_dealer_replay_from_the_middle(ctx: Sockets, layout: Any) -> None:
    with make(replay_endpoint="tcp://127.0.0.1:*", topic=b"t", replay_layout=layout) as pub:
        for i in range(5):
            pub.publish(events(i))
        wait_sent(pub, 5)
        assert pub.replay_endpoint is not None
        dealer = ctx(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        replies = replay(dealer, 2)
        width = 3 if layout == "legacy" else 4
        assert [len(f) for f in replies] == [width] * 4
        messages = [decode_replay_reply(f) for f in replies]
        assert messages[-1] is None
        assert [m.seq for m in messages[:-1] if m] == [2, 3, 4]
        assert [m.topic for m in messages[:-1] if m] == [b"" if layout == "legacy" else b"t"] * 3
        assert [decode_batch(m.payload).events for m in messages[:-1] if m] == [
            events(i) for i in (2, 3, 4)
        ]
        end = replies[-1]
        assert end[-2:] == [b"\xff" * 8, b""]
        # past the newest batch: only the end marker
        assert len(replay(dealer, 99)) == 1


def test_req_replay_returns_the_first_message(ctx: Sockets) -> None:
    with make(replay_endpoint="tcp://127.0.0.1:*") as pub:
        for i in range(3):
            pub.publish(events(i))
        wait_sent(pub, 3)
        assert pub.replay_endpoint is not None
        req = ctx(zmq.REQ)
        req.connect(pub.replay_endpoint)
        req.send((1).to_bytes(8, "big"))
        message = decode_replay_reply(req.recv_multipart())
        assert message is not None and message.seq == 1
        assert decode_batch(message.payload).events == events(1)


def test_buffer_bound_drops_the_oldest(ctx: Sockets) -> None:
    with make(replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3) as pub:
        for i in range(5):
            pub.publish(events(i))
        wait_sent(pub, 5)
        assert pub.replay_endpoint is not None
        dealer = ctx(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        seqs = [m.seq for m in map(decode_replay_reply, replay(dealer, 0)) if m]
        assert seqs == [2, 3, 4]


def test_malformed_replay_requests_are_ignored(ctx: Sockets) -> None:
    with make(replay_endpoint="tcp://127.0.0.1:*") as pub:
        pub.publish(events(0))
        wait_sent(pub, 1)
        assert pub.replay_endpoint is not None
        dealer = ctx(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"short"])
        dealer.send_multipart([b"", b"x", b"\x00" * 8])
        dealer.send_multipart([b"\x00" * 8])  # no delimiter
        assert dealer.poll(300) == 0
        assert len(replay(dealer, 0)) == 2  # still serving


def test_connects_out_to_a_bound_subscriber(ctx: Sockets) -> None:
    port = free_port()
    sub = ctx(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    with make(endpoint=f"tcp://127.0.0.1:{port - 2}", data_parallel_rank=2) as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        # A bound SUB attaches the incoming connection, and the PUB learns the subscription,
        # only when each socket is next used: the first batches may be lost (slow joiner).
        for _ in range(50):
            pub.publish(events(0))
            if sub.poll(20):
                break
        message = decode_message(sub.recv_multipart())
        assert decode_batch(message.payload).data_parallel_rank == 2


async def test_engine_events_over_zmq_rebuild_its_cache(ctx: Sockets) -> None:
    from publishers.sim.engine import EngineConfig, GenerationRequest, SimulatedEngine
    from tests.publishers.sim.test_engine import Reference

    with make(era=WireEra.V0_22_0) as pub:
        sub = subscribe(ctx, pub.endpoint)
        published: list[list[Event]] = []

        class Tee:
            def publish(self, batch: list[Event]) -> None:
                published.append(batch)
                pub.publish(batch)

        engine = SimulatedEngine(EngineConfig(num_blocks=8, block_size=4, time_scale=0), Tee())
        await engine.start()
        streams = [
            engine.add_request(GenerationRequest(f"r{i}", [i % 3] * 10 + [i], max_tokens=6))
            for i in range(6)
        ]
        for stream in streams:
            async for _ in stream:
                pass
        await engine.stop()
        wait_sent(pub, len(published))
        reference = Reference()
        for seq in range(len(published)):
            message = decode_message(sub.recv_multipart())
            assert message.seq == seq
            reference.apply(decode_batch(message.payload).events)
        assert reference.blocks == engine.cached_blocks()
        assert sum(reference.copies.values()) > 0


def test_endpoint_rules() -> None:
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/x")
    assert binds("inproc://events") and not binds("tcp://10.0.0.1:5557")
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://*:5557", 3) == "tcp://*:5560"
    assert endpoint_for_rank("inproc://ev", 1) == "inproc://ev_dp1"
    with pytest.raises(ValueError, match="rank"):
        endpoint_for_rank("ipc:///tmp/x", 1)


def test_close_is_prompt_and_final() -> None:
    pub = make(replay_endpoint="tcp://127.0.0.1:*")
    pub.publish(events(0))
    started = time.monotonic()
    pub.close()
    assert time.monotonic() - started < 1.0
    assert pub.next_seq == 1  # queued batches are sent before the thread exits
    pub.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(events(1))


def test_bind_errors_surface_in_the_constructor(ctx: Sockets) -> None:
    taken = ctx(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(zmq.ZMQError):
        make(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{port}")


@pytest.mark.parametrize(
    ("era", "extra"),
    [
        (WireEra.V0_33_0, [["ad", "s"], ["ad"]]),
        (WireEra.V0_26_0, [["ad", "s"], ["ad"]]),
        (WireEra.V0_24_0, [["s"], None]),
        (WireEra.V0_17_0, [["s"], None]),
    ],
)
def test_lora_extra_keys_as_each_era_emits_them(era: WireEra, extra: Any) -> None:
    event = BlockStored([1, 2], None, [1, 2, 3, 4], 2, lora_name="ad")
    event = msgspec.structs.replace(event, extra_keys=[("ad", "s"), ("ad",)])
    emitted = decode_batch(encode_batch(as_emitted(EventBatch(1.0, [event], 0), era), era))
    (out,) = emitted.events
    assert isinstance(out, BlockStored)
    assert out.extra_keys == extra
    unsalted = msgspec.structs.replace(event, extra_keys=[("ad",), ("ad",)])
    (bare,) = as_emitted(EventBatch(1.0, [unsalted], 0), era).events
    assert isinstance(bare, BlockStored)
    assert bare.extra_keys == (None if not era.at_least(WireEra.V0_26_0) else [("ad",), ("ad",)])

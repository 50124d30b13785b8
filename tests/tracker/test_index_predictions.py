"""The BlockIndex contract on every backend: predictions, homes and the survey routers read."""

from __future__ import annotations

import asyncio

from tests.factories import LLAMA
from tests.tracker.contract import OTHER, SEQ, offload, put, remove, store
from tracker.core.blocks import Namespace, block_keys, session_key
from tracker.core.events import AllBlocksCleared
from tracker.core.index import BlockIndex, Route
from tracker.core.keys import home_anchors

# ------------------------------------------------------------------ predictions


async def predicted(
    index: BlockIndex, tokens: list[int], ns: Namespace = LLAMA
) -> dict[str, tuple[int, int, int]]:
    found = await index.lookup(ns, block_keys(tokens, ns))
    return {r: (m.blocks, m.gpu_blocks, m.predicted_blocks) for r, m in found.items()}


async def test_predictions_match_a_new_prefix_until_they_expire(index: BlockIndex) -> None:
    await index.predict(LLAMA, "a", block_keys(SEQ, LLAMA), ttl_s=0.4)
    assert await predicted(index, SEQ) == {"a": (4, 4, 4)}
    assert await predicted(index, [*SEQ[:8], *OTHER]) == {"a": (2, 2, 2)}
    await asyncio.sleep(0.6)
    assert await predicted(index, SEQ) == {}


async def test_predictions_extend_real_matches_where_events_end(index: BlockIndex) -> None:
    await put(index, "a", store(SEQ, range(2)))
    await put(index, "b", store(SEQ, range(2)))
    await index.predict(LLAMA, "a", block_keys(SEQ, LLAMA)[2:], ttl_s=5)
    assert await predicted(index, SEQ) == {"a": (4, 4, 2), "b": (2, 2, 0)}


async def test_real_events_supersede_predictions(index: BlockIndex) -> None:
    await index.predict(LLAMA, "a", block_keys(SEQ, LLAMA), ttl_s=5)
    await put(index, "a", store(SEQ))
    assert await predicted(index, SEQ) == {"a": (4, 4, 0)}


async def test_an_eviction_cancels_the_prediction_of_that_block(index: BlockIndex) -> None:
    keys = block_keys(SEQ, LLAMA)
    await index.predict(LLAMA, "a", keys, ttl_s=30)
    await put(index, "a", store(SEQ))
    await put(index, "a", remove(SEQ, 3, 2))  # vLLM evicts a chain's tail first
    # without the cancellation the walk would go on over blocks 2, 3 on their prediction
    assert await predicted(index, SEQ) == {"a": (2, 2, 0)}
    await put(index, "a", remove(SEQ, 1, 0))
    assert await predicted(index, SEQ) == {}


async def test_a_cleared_replica_loses_its_predictions_of_stored_blocks(
    index: BlockIndex,
) -> None:
    keys = block_keys(SEQ, LLAMA)
    await index.predict(LLAMA, "a", keys, ttl_s=30)
    await index.predict(LLAMA, "b", keys, ttl_s=30)
    await put(index, "a", store(SEQ, range(3)))
    await put(index, "a", AllBlocksCleared())
    # block 3 was never stored: its prediction stands (the request may still be running)
    assert await predicted(index, SEQ) == {"b": (4, 4, 4)}
    await put(index, "b", store(SEQ), remove(SEQ, 3))
    assert await predicted(index, SEQ) == {"b": (3, 3, 0)}


async def test_residency_counts_held_and_stored_gpu_blocks(index: BlockIndex) -> None:
    survey = await index.survey(LLAMA, block_keys(SEQ, LLAMA))
    assert survey.residency == {}
    await put(index, "a", store(SEQ), offload(SEQ, 0, 1))
    await put(index, "b", store(SEQ, range(2)))
    await put(index, "a", remove(SEQ, 3, 2), store(OTHER, range(1)))
    survey = await index.survey(LLAMA, block_keys(SEQ, LLAMA))
    assert {r: (m.blocks, m.gpu_blocks) for r, m in survey.matches.items()} == {
        "a": (2, 2),
        "b": (2, 2),
    }
    assert {r: (c.blocks, c.stored) for r, c in survey.residency.items()} == {
        "a": (3, 5),
        "b": (2, 2),
    }
    await put(index, "a", AllBlocksCleared())
    survey = await index.survey(LLAMA, [])
    assert survey.matches == {}
    assert (survey.residency["a"].blocks, survey.residency["a"].stored) == (0, 5)


async def test_lookahead_widths_are_surveyed_per_replica(index: BlockIndex) -> None:
    assert (await index.survey(LLAMA, [])).lookahead == {}
    await index.set_lookahead("a", LLAMA, 2)
    await index.set_lookahead("b", LLAMA, 0)  # no lookahead: nothing to say
    await index.set_lookahead("c", Namespace("other", LLAMA.block_size), 1)
    # an adapter's partition is the base's
    lora = Namespace(LLAMA.model, LLAMA.block_size, "adapter")
    assert (await index.survey(lora, block_keys(SEQ, LLAMA))).lookahead == {"a": 2}
    await index.set_lookahead("a", LLAMA, 0)
    assert (await index.survey(LLAMA, [])).lookahead == {}


async def test_homes_name_the_last_replica_each_anchor_was_routed_to(index: BlockIndex) -> None:
    long = list(range(5000, 5040))  # 10 blocks of 4
    keys = block_keys(long, LLAMA)
    assert home_anchors(len(keys)) == [0, 1, 3, 7, 9]
    await index.claim(LLAMA, "a", [keys[p] for p in home_anchors(len(keys))], ttl_s=0.6)
    # a prompt sharing 5 blocks meets a's anchors 0, 1, 3 (its own 4, 7 were never claimed)
    sibling = block_keys([*long[:20], *OTHER], LLAMA)
    survey = await index.survey(LLAMA, sibling)
    assert {r: h.blocks for r, h in survey.homes.items()} == {"a": 4}
    assert 0 <= survey.homes["a"].age_s < 0.5
    assert survey.matches == {}  # a home says where a prefix went, not what is cached
    # b takes over the shared part; a keeps the depth only it was routed with
    await index.claim(LLAMA, "b", [sibling[p] for p in home_anchors(len(sibling))], ttl_s=5)
    survey = await index.survey(LLAMA, keys)
    assert {r: h.blocks for r, h in survey.homes.items()} == {"b": 4, "a": 10}
    await asyncio.sleep(0.8)
    survey = await index.survey(LLAMA, keys)
    assert {r: h.blocks for r, h in survey.homes.items()} == {"b": 4}


async def test_a_route_predicts_the_chain_and_claims_its_anchors_at_once(
    index: BlockIndex,
) -> None:
    """What a router writes after each request: both records, each with its own expiry."""
    keys = block_keys(SEQ, LLAMA)
    anchors = [keys[p] for p in home_anchors(len(keys))]
    await index.route(LLAMA, Route("a", keys[1:], 0.3, anchors, 5))
    await put(index, "a", store(SEQ, range(1)))  # the engine's word on the first block
    survey = await index.survey(LLAMA, keys)
    assert {r: (m.blocks, m.predicted_blocks) for r, m in survey.matches.items()} == {"a": (4, 3)}
    assert {r: h.blocks for r, h in survey.homes.items()} == {"a": 4}
    await asyncio.sleep(0.5)  # the predictions expire, the home stays
    survey = await index.survey(LLAMA, keys)
    assert {r: (m.blocks, m.predicted_blocks) for r, m in survey.matches.items()} == {"a": (1, 0)}
    assert {r: h.blocks for r, h in survey.homes.items()} == {"a": 4}
    # either part alone
    await index.route(LLAMA, Route("b", [], 5, anchors, 5))
    await index.route(LLAMA, Route("c", block_keys(OTHER, LLAMA), 5, [], 5))
    survey = await index.survey(LLAMA, keys)
    assert {r: h.blocks for r, h in survey.homes.items()} == {"b": 4}
    assert await predicted(index, OTHER) == {"c": (4, 4, 4)}
    assert (await index.survey(LLAMA, block_keys(OTHER, LLAMA))).homes == {}


async def test_an_expired_home_is_not_reported_while_its_bucket_lives_on(
    index: BlockIndex,
) -> None:
    # two anchors in one Redis bucket (same top 14 bits): b's fresh claim keeps the bucket
    # alive; a's record beside it has expired and must not be read as a deeper home
    first, second = (5 << 50) | 1, (5 << 50) | 2
    await index.claim(LLAMA, "a", [first, second], ttl_s=0.3)
    await index.claim(LLAMA, "b", [first], ttl_s=5)
    await asyncio.sleep(0.4)
    survey = await index.survey(LLAMA, [first, second])
    assert {r: h.blocks for r, h in survey.homes.items()} == {"b": 1}


async def test_a_replica_that_stopped_matching_is_not_revived_by_predictions(
    index: BlockIndex,
) -> None:
    await put(index, "a", store(SEQ, range(1)))
    await index.predict(LLAMA, "b", block_keys(SEQ, LLAMA)[1:], ttl_s=5)
    assert await predicted(index, SEQ) == {"a": (1, 1, 0)}


async def test_newer_prediction_of_the_same_replica_replaces_the_older(index: BlockIndex) -> None:
    keys = block_keys(SEQ, LLAMA)
    await index.predict(LLAMA, "a", keys, ttl_s=0.3)
    await index.predict(LLAMA, "a", keys, ttl_s=5)
    await index.predict(LLAMA, "b", keys[:1], ttl_s=5)
    await asyncio.sleep(0.5)
    assert await predicted(index, SEQ) == {"a": (4, 4, 4), "b": (1, 1, 1)}


async def test_a_session_home_follows_the_last_route_of_the_session(index: BlockIndex) -> None:
    """A session key is claimed with the route's anchors; the survey names its replica,
    claiming the whole chain asked about, apart from where the chain's own anchors went."""
    keys = block_keys(SEQ, LLAMA)
    session = session_key(LLAMA, "agent-7")
    assert session != session_key(LLAMA, "agent-8")
    assert session != session_key(Namespace(LLAMA.model, LLAMA.block_size, "lora"), "agent-7")
    assert (await index.survey(LLAMA, keys, session=session)).session == {}
    anchors = [keys[p] for p in home_anchors(len(keys))]
    await index.route(LLAMA, Route("a", keys, 5, [*anchors, session], 0.6))
    other = block_keys(OTHER, LLAMA)  # the session's next prompt need not share a block
    survey = await index.survey(LLAMA, other, session=session)
    assert {r: h.blocks for r, h in survey.session.items()} == {"a": len(other)}
    assert 0 <= survey.session["a"].age_s < 0.5
    assert survey.homes == {}
    assert (await index.survey(LLAMA, other)).session == {}  # asked only when named
    await index.claim(LLAMA, "b", [session], ttl_s=5)  # the session moved
    assert set((await index.survey(LLAMA, keys, session=session)).session) == {"b"}
    assert set((await index.survey(LLAMA, keys, session=session)).homes) == {"a"}
    await asyncio.sleep(0.7)
    survey = await index.survey(LLAMA, keys, session=session_key(LLAMA, "agent-7"))
    assert set(survey.session) == {"b"} and survey.homes == {}
    # a chain long enough for segments (read after the session in the same call)
    long = list(range(9000, 9000 + LLAMA.block_size * 70))
    await put(index, "a", store(long))
    survey = await index.survey(LLAMA, block_keys(long, LLAMA), session=session)
    assert survey.matches["a"].blocks == 70
    assert set(survey.session) == {"b"} and survey.session["b"].blocks == 70


async def test_each_replica_counts_the_other_sessions_living_there(index: BlockIndex) -> None:
    """A route that names a session makes it live on its replica for the route's window, and
    on no other (a move, even one with nothing left to predict); a survey asked for a
    session counts each replica's others."""
    keys = block_keys(SEQ, LLAMA)
    s = [session_key(LLAMA, f"agent-{i}") for i in range(4)]
    for i, replica in ((0, "a"), (1, "a"), (2, "b")):
        route = Route(replica, keys, 5, [s[i]], 5, session=s[i], session_ttl_s=0.6)
        await index.route(LLAMA, route)
    assert (await index.survey(LLAMA, keys)).sessions == {}  # asked only with a session
    assert (await index.survey(LLAMA, keys, session=s[3])).sessions == {"a": 2, "b": 1}
    assert (await index.survey(LLAMA, keys, session=s[0])).sessions == {"a": 1, "b": 1}
    await index.route(LLAMA, Route("b", (), 5, [s[1]], 5, session=s[1], session_ttl_s=0.6))
    assert (await index.survey(LLAMA, keys, session=s[3])).sessions == {"a": 1, "b": 2}
    other = Namespace("another-model", LLAMA.block_size)  # partitions stay apart
    assert (await index.survey(other, keys, session=s[3])).sessions == {}
    await asyncio.sleep(0.7)
    assert (await index.survey(LLAMA, keys, session=s[3])).sessions == {}

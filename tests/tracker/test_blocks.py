"""Block-key tests: determinism, chaining, namespaces, extra keys, partial blocks."""

from __future__ import annotations

from array import array

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.factories import LLAMA
from tracker.core.blocks import ChainCache, Namespace, block_keys, namespace_seed, token_bytes

TOKENS = list(range(100, 132))  # 8 blocks of 4


def test_keys_are_deterministic_and_one_per_full_block() -> None:
    keys = block_keys(TOKENS, LLAMA)
    assert len(keys) == 8
    assert keys == block_keys(list(TOKENS), Namespace("llama", 4))
    assert len(set(keys)) == 8
    assert all(0 <= k < 1 << 64 for k in keys)


def test_key_formula_is_the_documented_one() -> None:
    """key_0 = XXH3_64(tokens as uint32 LE, seed=namespace seed); key_i seeded by key_{i-1}."""
    first = xxhash.xxh3_64_intdigest(
        b"".join(t.to_bytes(4, "little") for t in TOKENS[:4]), LLAMA.seed
    )
    second = xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in TOKENS[4:8]), first)
    assert block_keys(TOKENS[:8], LLAMA) == [first, second]
    assert LLAMA.seed == namespace_seed("llama", None, 4)


def test_chaining_second_half_from_last_key_of_first_half() -> None:
    whole = block_keys(TOKENS, LLAMA)
    head = block_keys(TOKENS[:16], LLAMA)
    tail = block_keys(TOKENS[16:], LLAMA, parent=head[-1])
    assert head + tail == whole


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, (1 << 32) - 1), max_size=80),
    st.integers(1, 8),
    st.integers(0, 20),
    st.none() | st.text(max_size=5),
)
def test_chaining_identity_property(
    tokens: list[int], block_size: int, split: int, lora: str | None
) -> None:
    ns = Namespace("m", block_size, lora)
    whole = block_keys(tokens, ns)
    cut = min(split, len(whole)) * block_size
    head = block_keys(tokens[:cut], ns)
    tail = block_keys(tokens[cut:], ns, parent=head[-1] if head else None)
    assert head + tail == whole
    assert len(whole) == len(tokens) // block_size


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(Namespace("mistral", 4), id="model"),
        pytest.param(Namespace("llama", 4, "adapter-a"), id="lora"),
        pytest.param(Namespace("llama", 8), id="block-size"),
    ],
)
def test_namespace_changes_every_key(other: Namespace) -> None:
    mine = block_keys(TOKENS, LLAMA)
    theirs = block_keys(TOKENS, other)
    assert not set(mine) & set(theirs)


def test_two_loras_differ_and_empty_lora_is_no_lora() -> None:
    a = block_keys(TOKENS, Namespace("llama", 4, "a"))
    b = block_keys(TOKENS, Namespace("llama", 4, "b"))
    assert not set(a) & set(b)
    assert block_keys(TOKENS, Namespace("llama", 4, "")) == block_keys(TOKENS, LLAMA)


def test_namespace_base_drops_the_lora_only() -> None:
    assert Namespace("llama", 4, "a").base() == LLAMA
    assert Namespace("llama", 4, "").base() == LLAMA
    assert LLAMA.base() is LLAMA


@pytest.mark.parametrize("block_size", [0, -1])
def test_namespace_rejects_bad_block_size(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        Namespace("m", block_size)


@pytest.mark.parametrize("block", [0, 3, 7])
def test_extra_key_changes_its_block_and_later_ones_only(block: int) -> None:
    plain = block_keys(TOKENS, LLAMA)
    extra: list[object] = [None] * 8
    extra[block] = ["salt"]
    salted = block_keys(TOKENS, LLAMA, extra_keys=extra)
    assert salted[:block] == plain[:block]
    assert all(s != p for s, p in zip(salted[block:], plain[block:], strict=True))


def test_extra_keys_all_none_or_short_list_is_no_extra() -> None:
    plain = block_keys(TOKENS, LLAMA)
    assert block_keys(TOKENS, LLAMA, extra_keys=[None] * 8) == plain
    assert block_keys(TOKENS, LLAMA, extra_keys=[]) == plain
    short = block_keys(TOKENS, LLAMA, extra_keys=[("s",)])
    assert short[0] != plain[0]
    assert len(short) == 8


def test_extra_keys_tuples_and_lists_agree() -> None:
    """Decoded events carry lists where the router builds tuples; both must hash alike."""
    as_tuples = block_keys(TOKENS, LLAMA, extra_keys=[("img", 3), None])
    as_lists = block_keys(TOKENS, LLAMA, extra_keys=[["img", 3], None])
    assert as_tuples == as_lists
    assert block_keys(TOKENS, LLAMA, extra_keys=[("img", 4), None]) != as_tuples


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_partial_trailing_block_is_ignored(extra: int) -> None:
    assert block_keys(TOKENS + list(range(extra)), LLAMA) == block_keys(TOKENS, LLAMA)
    assert block_keys(TOKENS[:3], LLAMA) == []


def test_bytes_array_and_list_inputs_agree() -> None:
    keys = block_keys(TOKENS, LLAMA)
    assert block_keys(token_bytes(TOKENS), LLAMA) == keys
    assert block_keys(array("I", TOKENS), LLAMA) == keys
    assert block_keys(tuple(TOKENS), LLAMA) == keys
    assert token_bytes(TOKENS)[:8] == (100).to_bytes(4, "little") + (101).to_bytes(4, "little")


@pytest.mark.parametrize(("limit", "count"), [(0, 0), (1, 1), (5, 5), (8, 8), (100, 8)])
def test_limit(limit: int, count: int) -> None:
    keys = block_keys(TOKENS, LLAMA, limit=limit)
    assert keys == block_keys(TOKENS, LLAMA)[:count]
    assert (
        block_keys(TOKENS, LLAMA, limit=limit, extra_keys=[("s",)])
        == block_keys(TOKENS, LLAMA, extra_keys=[("s",)])[:count]
    )


def test_parent_changes_every_key() -> None:
    assert not set(block_keys(TOKENS, LLAMA)) & set(block_keys(TOKENS, LLAMA, parent=1))


def test_token_order_and_value_matter() -> None:
    keys = block_keys(TOKENS, LLAMA)
    swapped = [TOKENS[1], TOKENS[0], *TOKENS[2:]]
    assert block_keys(swapped, LLAMA)[0] != keys[0]
    assert block_keys([1 << 31, *TOKENS[1:]], LLAMA)[0] != keys[0]


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [1 << 32, 0, 0, 0]])
def test_out_of_range_tokens_raise(bad: list[int]) -> None:
    with pytest.raises(OverflowError):
        block_keys(bad, LLAMA)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 4_000), st.integers(0, 700)),
        min_size=1,
        max_size=12,
    )
)
def test_chain_cache_gives_block_keys_exactly(plan: list[tuple[int, int, int]]) -> None:
    """Prompts that share prefixes of every length with earlier ones, differ inside a block,
    outgrow the cache or come from another namespace: always block_keys' answer."""
    bases = [[(7 * b + i) % 50_000 for i in range(4_000)] for b in range(4)]
    cache = ChainCache(max_blocks=400, min_blocks=4)
    for base, cut, extra in plan:
        tokens = bases[base][:cut] + [(cut + i) % 997 for i in range(extra)]
        namespace = LLAMA if base % 2 else Namespace("other", 32)
        assert cache.keys(tokens, namespace) == block_keys(tokens, namespace)
        assert cache.blocks <= cache.max_blocks


def test_chain_cache_reuses_a_repeated_prefix_and_stays_bounded() -> None:
    cache = ChainCache(max_blocks=1_000, min_blocks=4)
    ns16 = Namespace("llama", 16)
    system = list(range(16 * 300))
    cache.keys([*system, 1, 2, 3], ns16)
    assert cache.reused == 0
    # a new question after the same system prompt: its 300 blocks are reused, not hashed
    assert cache.keys([*system, *range(50)], ns16) == block_keys([*system, *range(50)], ns16)
    assert cache.reused == 300
    # a change inside block 100: blocks 0..99 reused
    changed = [*system[:1_605], 0, *system[1_606:]]
    assert cache.keys(changed, ns16) == block_keys(changed, ns16)
    assert cache.reused == 400
    # extra keys (a cache salt) and short prompts are hashed in full, never cached
    salted = cache.keys(system, ns16, extra_keys=[("salt",)])
    assert salted == block_keys(system, ns16, extra_keys=[("salt",)]) and cache.reused == 400
    for start in range(0, 4_000, 1_000):  # other prefixes push the oldest out
        cache.keys(list(range(start + 100_000, start + 100_000 + 16 * 300)), ns16)
    assert cache.blocks <= 1_000
    with pytest.raises(ValueError):
        ChainCache(min_blocks=0)


def test_chain_cache_keeps_interleaved_sessions_on_one_preamble_apart() -> None:
    """Agent sessions share a preamble (their first blocks) and take turns: each turn reuses
    its own session's history, not only the preamble the last prompt seen shares."""
    cache = ChainCache(max_blocks=100_000, min_blocks=4, per_start=4)
    ns16 = Namespace("llama", 16)
    preamble = list(range(16 * 50))
    histories = [[*preamble, *range(1_000 * (s + 1), 1_000 * (s + 1) + 16 * 100)] for s in range(3)]
    for history in histories:
        cache.keys(history, ns16)
    assert cache.reused == 2 * 50  # the second and third found only the preamble
    for turn in range(1, 3):
        for s, history in enumerate(histories):
            before = cache.reused
            history.extend(range(50_000 + 100 * turn + s, 50_000 + 100 * turn + s + 16 * 10))
            assert cache.keys(history, ns16) == block_keys(history, ns16)
            # the whole previous turn came from the cache: 150 blocks, then 160
            assert cache.reused - before == 150 + 10 * (turn - 1)
    # each turn took its previous turn's place: one entry per session
    assert cache.blocks == sum(len(h) // 16 for h in histories)
    # a fifth prompt on the preamble pushes the least recent of that start out (per_start)
    for extra in range(2):
        cache.keys([*preamble, *range(90_000 + 1_000 * extra, 90_000 + 1_000 * extra + 160)], ns16)
    before = cache.reused
    assert cache.keys(histories[0], ns16) == block_keys(histories[0], ns16)
    assert cache.reused - before == 50  # session 0's entry was the oldest: only the preamble
    with pytest.raises(ValueError):
        ChainCache(per_start=0)


def test_lookahead_folds_the_next_tokens_into_each_block() -> None:
    """vLLM 0.33's lookahead hashing: block i hashes its tokens and the ``L`` after it."""
    ns = Namespace("m", 4)
    tokens = list(range(100, 111))  # 2 full blocks and 3 tokens
    keys = block_keys(tokens, ns, lookahead=2)
    first = xxhash.xxh3_64_intdigest(token_bytes(tokens[0:6]), ns.seed)
    assert keys == [first, xxhash.xxh3_64_intdigest(token_bytes(tokens[4:10]), first)]
    assert keys[0] != block_keys(tokens, ns)[0]
    # a block without L tokens after it gets no key: the engine cannot hash it yet
    assert len(block_keys(tokens, ns, lookahead=4)) == 1
    assert block_keys(tokens[:8], ns, lookahead=1) == block_keys(tokens[:9], ns, lookahead=1)[:1]
    # the same block followed by other tokens is another block
    other = [*tokens[:4], 999, *tokens[5:]]
    assert block_keys(other, ns, lookahead=2)[0] != keys[0]
    assert block_keys(other, ns, lookahead=0)[0] == block_keys(tokens, ns)[0]


def test_chain_cache_with_lookahead_gives_block_keys() -> None:
    ns = Namespace("m", 4)
    cache = ChainCache(min_blocks=1)
    tokens = list(range(200))
    for lookahead in (0, 1, 3):
        assert cache.keys(tokens, ns, lookahead=lookahead) == block_keys(
            tokens, ns, lookahead=lookahead
        )

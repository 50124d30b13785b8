"""The approximate text radix tree behind the sglang baseline."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.baselines.texttree import TextTree, shared_prefix


@given(st.text(alphabet="ab", max_size=40), st.text(alphabet="ab", max_size=40))
def test_shared_prefix_is_the_common_prefix_length(a: str, b: str) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert shared_prefix(a, b) == n


def test_match_walks_into_the_middle_of_a_node_and_names_the_holder() -> None:
    tree = TextTree()
    tree.insert("system prompt A: question 1", "r0", now=1.0)
    tree.insert("system prompt B: question 2", "r1", now=2.0)
    found = tree.match("system prompt A: other")
    assert (found.chars, found.tenant) == (len("system prompt A: "), "r0")
    found = tree.match("system prompt C")
    assert found.chars == len("system prompt ")
    assert found.tenant == "r1"  # both hold "system prompt ": the most recent wins
    assert tree.match("unrelated").tenant is None


def test_match_only_considers_allowed_tenants() -> None:
    tree = TextTree()
    tree.insert("abcdef", "r0", now=1.0)
    tree.insert("abcxyz", "r1", now=2.0)
    found = tree.match("abcdef", tenants={"r1"})
    assert (found.chars, found.tenant) == (3, "r1")  # what r1 holds of it


def test_sizes_count_each_tenants_characters_once() -> None:
    tree = TextTree()
    tree.insert("hello world", "r0", now=1.0)
    tree.insert("hello there", "r0", now=2.0)
    tree.insert("hello world", "r1", now=3.0)
    assert tree.size("r0") == len("hello world") + len("there")
    assert tree.size("r1") == len("hello world")


def test_eviction_drops_least_recently_used_leaves_first() -> None:
    tree = TextTree(max_size=15)
    tree.insert("prefix-old-aaaa", "r0", now=1.0)
    tree.insert("prefix-new-bbbb", "r0", now=2.0)
    tree.evict()
    assert tree.size("r0") == 15
    assert tree.match("prefix-new-bbbb").chars == len("prefix-new-bbbb")
    assert tree.match("prefix-old-aaaa").chars == len("prefix-")
    tree.remove_tenant("r0")
    assert tree.size("r0") == 0 and tree.match("prefix-new-bbbb").tenant is None

"""A multi-tenant radix tree over request text: SGLang's approximate cache model, for a baseline.

SGLang's ``cache_aware`` router (``sgl-model-gateway/src/policies/tree.rs``) does not see the
engines' caches. It remembers the text of every request it sent, per worker (tenant), in one
character-level radix tree, and assumes a worker still holds what it was sent until the tree
evicts it (least recently used leaves first, when a tenant's text exceeds ``max_size``
characters). This is that tree: :meth:`TextTree.insert` after each decision,
:meth:`TextTree.match` before it. Pure, no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass, field


def shared_prefix(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b`` (slice comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(eq=False, slots=True)
class _Node:
    text: str
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)
    tenants: dict[str, float] = field(default_factory=dict)  # tenant -> last access


@dataclass(frozen=True, slots=True)
class TextMatch:
    """The longest stored prefix of a text and the tenant that holds it."""

    chars: int
    tenant: str | None


class TextTree:
    """Per-tenant approximate prefix cache over text (see the module docstring).

    :param max_size: characters a tenant may hold before :meth:`evict` trims it.
    """

    def __init__(self, max_size: int = 1 << 26) -> None:
        self.max_size = max_size
        self.root = _Node("", None)
        self.sizes: dict[str, int] = {}

    def insert(self, text: str, tenant: str, now: float) -> None:
        """Record that ``tenant`` was sent ``text`` at time ``now``."""
        node = self.root
        node.tenants[tenant] = now
        self.sizes.setdefault(tenant, 0)
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, tenants={tenant: now})
                node.children[text[i]] = leaf
                self.sizes[tenant] += len(leaf.text)
                return
            shared = shared_prefix(child.text, text[i:])
            if shared < len(child.text):
                child = self._split(node, child, shared)
            if tenant not in child.tenants:
                self.sizes[tenant] += len(child.text)
            child.tenants[tenant] = now
            node = child
            i += shared

    @staticmethod
    def _split(parent: _Node, child: _Node, at: int) -> _Node:
        middle = _Node(child.text[:at], parent, tenants=dict(child.tenants))
        child.text = child.text[at:]
        child.parent = middle
        middle.children[child.text[0]] = child
        parent.children[middle.text[0]] = middle
        return middle

    def match(self, text: str, tenants: Collection[str] | None = None) -> TextMatch:
        """Longest prefix of ``text`` in the tree and the tenant holding it.

        The walk follows the text as far as the tree has it (into the middle of a node);
        the tenant is the most recently used one at the deepest node reached that holds any
        of ``tenants`` (every tenant when None). SGLang picks an arbitrary tenant of that
        node; the most recent one is a deterministic stand-in.
        """
        node, i = self.root, 0
        path: list[tuple[_Node, int]] = []
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            shared = shared_prefix(child.text, text[i:])
            i += shared
            path.append((child, i))
            if shared < len(child.text):
                break
            node = child
        for deepest, chars in reversed(path):
            held = [(at, t) for t, at in deepest.tenants.items() if tenants is None or t in tenants]
            if held:
                return TextMatch(chars, max(held)[1])
        return TextMatch(0, None)

    def size(self, tenant: str) -> int:
        """Characters stored for ``tenant``."""
        return self.sizes.get(tenant, 0)

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything of ``tenant`` (a worker that left)."""
        while self.sizes.get(tenant, 0) > 0:
            self._evict(tenant, 0)
        self.sizes.pop(tenant, None)
        self.root.tenants.pop(tenant, None)

    def evict(self) -> None:
        """Trim every tenant above ``max_size``, least recently used leaves first."""
        for tenant, size in list(self.sizes.items()):
            if size > self.max_size:
                self._evict(tenant, self.max_size)

    def _leaves(self, tenant: str) -> list[tuple[float, int, _Node]]:
        out: list[tuple[float, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            below = [c for c in node.children.values() if tenant in c.tenants]
            if below:
                stack.extend(below)
            elif node is not self.root and tenant in node.tenants:
                out.append((node.tenants[tenant], id(node), node))
        return out

    def _evict(self, tenant: str, target: int) -> None:
        heap = self._leaves(tenant)
        heapq.heapify(heap)
        while heap and self.sizes[tenant] > target:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self.sizes[tenant] -= len(node.text)
            parent = node.parent
            assert parent is not None
            if not node.tenants and not node.children:
                del parent.children[node.text[0]]
            if parent is not self.root and not any(
                tenant in c.tenants for c in parent.children.values()
            ):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))

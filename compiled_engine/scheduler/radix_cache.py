"""Radix-tree prefix cache: page-aligned keys, lock references, LRU eviction of unlocked leaves."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from compiled_engine.scheduler.allocator import PageAllocator
from compiled_engine.scheduler.prefix_cache import PrefixCache


class RadixNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "id")

    def __init__(self, key: tuple[int, ...], pages: tuple[int, ...], parent: RadixNode | None, nid: int):
        self.key = key  # tokens of this edge; len(key) == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}  # first page of the child's key -> child
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0  # logical clock, never wall time (ranks must agree)
        self.id = nid


class RadixCache(PrefixCache):
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._next_id = 1
        self.root = RadixNode((), (), None, 0)
        self._clock = 0
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes
        self.hit_tokens = 0
        self.queried_tokens = 0

    # -- lookup / insert -------------------------------------------------------------------------

    def _common(self, key: tuple[int, ...], tokens: tuple[int, ...], i: int, n: int) -> int:
        """Page-aligned length of the common prefix of ``key`` and ``tokens[i:n]``."""
        ps = self.page_size
        lim = min(len(key), n - i)
        m = ps  # the first page matched through the children dict
        while m + ps <= lim and key[m : m + ps] == tokens[i + m : i + m + ps]:
            m += ps
        return m

    def _walk(self, tokens: tuple[int, ...], n: int) -> tuple[RadixNode, list[int], int]:
        """Follow ``tokens[:n]`` (page-aligned n) splitting a node where the match ends inside it."""
        ps = self.page_size
        self._clock += 1
        node, pages, i = self.root, [], 0
        while i < n:
            child = node.children.get(tokens[i : i + ps])
            if child is None:
                break
            m = self._common(child.key, tokens, i, n)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = self._clock
            pages.extend(child.pages)
            node, i = child, i + m
        return node, pages, i

    def match(self, tokens: Sequence[int]) -> tuple[RadixNode, tuple[int, ...]]:
        tokens = tuple(tokens)
        node, pages, _ = self._walk(tokens, len(tokens) // self.page_size * self.page_size)
        return node, tuple(pages)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[RadixNode, tuple[int, ...]]:
        ps = self.page_size
        n = len(pages) * ps
        assert len(tokens) == n, f"insert: {len(tokens)} tokens for {len(pages)} pages of {ps}"
        tokens = tuple(tokens)
        node, out, i = self._walk(tokens, n)
        if i < n:
            leaf = RadixNode(tokens[i:n], tuple(pages[i // ps :]), node, self._next_id)
            self._next_id += 1
            leaf.last_access = self._clock
            node.children[leaf.key[:ps]] = leaf
            self.evictable_size += n - i
            out.extend(leaf.pages)
            node = leaf
        return node, tuple(out)

    def _split(self, child: RadixNode, m: int) -> RadixNode:
        ps = self.page_size
        parent = child.parent
        assert parent is not None
        head = RadixNode(child.key[:m], child.pages[: m // ps], parent, self._next_id)
        self._next_id += 1
        head.lock_ref = child.lock_ref
        head.last_access = child.last_access
        child.key = child.key[m:]
        child.pages = child.pages[m // ps :]
        child.parent = head
        head.children[child.key[:ps]] = child
        parent.children[head.key[:ps]] = head
        return head

    # -- locks and eviction ----------------------------------------------------------------------

    def lock(self, handle: object) -> None:
        node = handle
        assert isinstance(node, RadixNode), "radix cache: foreign handle"
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: object) -> None:
        node = handle
        assert isinstance(node, RadixNode), "radix cache: foreign handle"
        while node is not self.root:
            assert node.lock_ref > 0, f"unlock of unlocked radix node {node.id}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            self.allocator.free(node.pages)
            freed += len(node.pages)
            self.evictable_size -= len(node.key)
            del parent.children[node.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    @property
    def evictable_pages(self) -> int:
        return self.evictable_size // self.page_size

    # -- inspection ------------------------------------------------------------------------------

    def _nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children, in insertion order."""
        out: list[RadixNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            kids = list(node.children.values())
            out.extend(kids)
            stack.extend(reversed(kids))
        return out

    def pages_of(self, handle: object) -> tuple[int, ...]:
        parts = []
        node = handle
        assert isinstance(node, RadixNode), "radix cache: foreign handle"
        while node is not self.root:
            parts.append(node.pages)
            node = node.parent
        return tuple(p for part in reversed(parts) for p in part)

    def cached_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def cached_sequences(self) -> list[tuple[int, ...]]:
        """The full token sequence of every leaf (tests use it as the cache's content)."""
        out = []
        for node in self._nodes():
            if not node.children:
                parts = []
                while node is not self.root:
                    parts.append(node.key)
                    node = node.parent
                out.append(tuple(t for part in reversed(parts) for t in part))
        return out

    def check(self, held: Sequence[object]) -> None:
        ps = self.page_size
        expected: dict[int, int] = {}
        for handle in held:
            node = handle
            assert isinstance(node, RadixNode), "radix cache: a lock on a foreign handle"
            while node is not self.root:
                expected[node.id] = expected.get(node.id, 0) + 1
                node = node.parent
        evictable = protected = 0
        for node in self._nodes():
            assert node.key and len(node.key) % ps == 0, f"radix node {node.id} key not page-aligned"
            assert len(node.pages) * ps == len(node.key), f"radix node {node.id} pages do not cover its key"
            assert isinstance(node.key, tuple) and isinstance(node.pages, tuple), "node must own its copies"
            for first, child in node.children.items():
                assert child.key[:ps] == first, f"radix node {child.id} filed under a wrong first page"
                assert child.parent is node, f"radix node {child.id} has a wrong parent"
            assert node.lock_ref == expected.get(node.id, 0), (
                f"radix node {node.id} lock_ref {node.lock_ref} != {expected.get(node.id, 0)} live locks"
            )
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            f"radix accounting: evictable {self.evictable_size} protected {self.protected_size}, "
            f"nodes say {evictable} / {protected}"
        )
        pages = self.cached_pages()
        assert len(set(pages)) == len(pages), "a page is cached twice in the radix tree"

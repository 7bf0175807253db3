"""Radix-tree prefix cache: page-aligned keys, lock references, LRU eviction of unlocked leaves.

Eviction is incremental: a heap holds an entry for every unlocked leaf, pushed when a node becomes
one or is touched; entries that went stale (the node was locked, grew a child, was touched again or
evicted) are skipped when popped, and the heap is rebuilt when they outnumber the nodes. So evicting
k pages costs O(k log n), not a walk of the whole tree."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from compiled_engine.scheduler.allocator import PageAllocator
from compiled_engine.scheduler.prefix_cache import CacheRemoved, CacheStored, PrefixCache


class RadixNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "id")

    def __init__(
        self, key: tuple[int, ...], pages: tuple[int, ...], parent: RadixNode | None, nid: int
    ):
        self.key = key  # tokens of this edge; len(key) == len(pages) * page_size
        self.pages = pages
        # first page of the child's key -> child
        self.children: dict[tuple[int, ...], RadixNode] = {}
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
        self._num_nodes = 0
        self.num_evicted_pages = 0
        # (last_access, id, node) of unlocked leaves
        self._heap: list[tuple[int, int, RadixNode]] = []

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
        """Follow ``tokens[:n]`` (page-aligned n) splitting a node where the match ends inside
        it."""
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
            self._offer(child)
            pages.extend(child.pages)
            node, i = child, i + m
        return node, pages, i

    def match(self, tokens: Sequence[int]) -> tuple[RadixNode, tuple[int, ...]]:
        tokens = tuple(tokens)
        node, pages, _ = self._walk(tokens, len(tokens) // self.page_size * self.page_size)
        return node, tuple(pages)

    def peek(self, tokens: Sequence[int]) -> int:
        tokens = tuple(tokens)
        ps = self.page_size
        n = len(tokens) // ps * ps
        node, i = self.root, 0
        while i < n:
            child = node.children.get(tokens[i : i + ps])
            if child is None:
                break
            m = self._common(child.key, tokens, i, n)
            i += m
            if m < len(child.key):
                break
            node = child
        return i // ps

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int]
    ) -> tuple[RadixNode, tuple[int, ...]]:
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
            self._num_nodes += 1
            self._offer(leaf)
            out.extend(leaf.pages)
            node = leaf
            if self.events is not None:
                self.events.append(CacheStored(tokens, i, leaf.pages))
        return node, tuple(out)

    def _split(self, child: RadixNode, m: int) -> RadixNode:
        ps = self.page_size
        parent = child.parent
        assert parent is not None
        head = RadixNode(child.key[:m], child.pages[: m // ps], parent, self._next_id)
        self._next_id += 1
        self._num_nodes += 1
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
                self._offer(node)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free unlocked leaves, least recently used first (ties: oldest node), until `num_pages`
        pages."""
        freed = 0
        heap = self._heap
        while freed < num_pages and heap:
            access, _, node = heapq.heappop(heap)
            if not self._evictable(node, access):
                continue  # a stale entry
            parent = node.parent
            if self.events is not None:
                path = self._path(node)
                self.events.append(CacheRemoved(path, len(path) - len(node.key)))
            self.allocator.free(node.pages)
            freed += len(node.pages)
            self.num_evicted_pages += len(node.pages)
            self.evictable_size -= len(node.key)
            self._num_nodes -= 1
            del parent.children[node.key[: self.page_size]]
            node.parent = None
            self._offer(parent)
        return freed

    def _evictable(self, node: RadixNode, access: int) -> bool:
        """Whether a heap entry stamped `access` still names an unlocked leaf in the tree."""
        return (
            node.parent is not None
            and not node.children
            and node.lock_ref == 0
            and node.last_access == access
        )

    def _offer(self, node: RadixNode) -> None:
        """Push `node` if it is an unlocked leaf now; rebuild the heap when stale entries dominate
        it."""
        if node is self.root or node.children or node.lock_ref:
            return
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._heap = [
                (n.last_access, n.id, n)
                for n in self._nodes()
                if not n.children and n.lock_ref == 0
            ]
            heapq.heapify(self._heap)

    @property
    def evictable_pages(self) -> int:
        return self.evictable_size // self.page_size

    @property
    def num_cached_pages(self) -> int:
        return (self.evictable_size + self.protected_size) // self.page_size

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

    def _path(self, node: RadixNode) -> tuple[int, ...]:
        """The tokens from the root to the end of `node`."""
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

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
        return [self._path(node) for node in self._nodes() if not node.children]

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
            assert node.key and len(node.key) % ps == 0, (
                f"radix node {node.id} key not page-aligned"
            )
            assert len(node.pages) * ps == len(node.key), (
                f"radix node {node.id} pages do not cover its key"
            )
            assert isinstance(node.key, tuple) and isinstance(node.pages, tuple), (
                "node must own its copies"
            )
            for first, child in node.children.items():
                assert child.key[:ps] == first, (
                    f"radix node {child.id} filed under a wrong first page"
                )
                assert child.parent is node, f"radix node {child.id} has a wrong parent"
            assert node.lock_ref == expected.get(node.id, 0), (
                f"radix node {node.id} lock_ref {node.lock_ref} != {expected.get(node.id, 0)} live "
                "locks"
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
        nodes = self._nodes()
        assert len(nodes) == self._num_nodes, (
            f"radix node count {self._num_nodes}, the tree has {len(nodes)}"
        )
        queued = {id(n) for access, _, n in self._heap if self._evictable(n, access)}
        for node in nodes:
            if not node.children and node.lock_ref == 0:
                assert id(node) in queued, (
                    f"radix leaf {node.id} is unlocked but not in the eviction heap"
                )

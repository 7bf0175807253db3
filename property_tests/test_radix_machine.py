"""Stateful test of the radix cache against a model: the set of cached page-aligned prefixes."""

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from compiled_engine.scheduler.allocator import PageAllocator
from compiled_engine.scheduler.radix_cache import RadixCache

tokens = st.lists(st.integers(0, 2), max_size=10)


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 3]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.alloc = PageAllocator(40, page_size)
        self.cache = RadixCache(self.alloc)
        self.model: dict[tuple[int, ...], int] = {}  # cached page-aligned prefix -> its last page
        self.held: list[tuple[object, tuple[int, ...]]] = []  # (handle, locked prefix)

    def _expected(self, seq: list[int]) -> tuple[int, ...]:
        pages = []
        for end in range(self.ps, len(seq) + 1, self.ps):
            page = self.model.get(tuple(seq[:end]))
            if page is None:
                break
            pages.append(page)
        return tuple(pages)

    @rule(seq=tokens, lock=st.booleans())
    def insert(self, seq: list[int], lock: bool) -> None:
        n = len(seq) // self.ps
        seq = seq[: n * self.ps]
        mine = self.alloc.alloc(n)
        if mine is None:
            self.evict(n - self.alloc.num_free)
            mine = self.alloc.alloc(n)
            if mine is None:
                return
        handle, cached = self.cache.insert(seq, mine)
        assert len(cached) == n, "insert must cache the whole page-aligned sequence"
        dups = []
        for i in range(n):
            prefix = tuple(seq[: (i + 1) * self.ps])
            if prefix in self.model:
                assert cached[i] == self.model[prefix], "insert replaced an existing cached page"
                assert cached[i] != mine[i]
                dups.append(mine[i])
            else:
                assert cached[i] == mine[i], "insert cached a page it was not offered"
                self.model[prefix] = mine[i]
        self.alloc.free(dups)
        assert self.cache.pages_of(handle) == cached
        if lock:
            self.cache.lock(handle)
            self.held.append((handle, tuple(seq)))

    @rule(seq=tokens, lock=st.booleans())
    def match(self, seq: list[int], lock: bool) -> None:
        handle, pages = self.cache.match(seq)
        assert pages == self._expected(seq), (
            f"match {seq}: got {pages}, model says {self._expected(seq)}"
        )
        assert self.cache.pages_of(handle) == pages
        if lock:
            self.cache.lock(handle)
            self.held.append((handle, tuple(seq[: len(pages) * self.ps])))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        handle, _ = self.held.pop(i % len(self.held))
        self.cache.unlock(handle)

    @rule(n=st.integers(1, 12))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_pages
        free_before = self.alloc.num_free
        freed = self.cache.evict(n)
        assert freed >= min(n, evictable), (
            f"evict({n}) freed {freed} of {evictable} evictable pages"
        )
        assert self.alloc.num_free == free_before + freed
        now = {
            seq[:end]
            for seq in self.cache.cached_sequences()
            for end in range(self.ps, len(seq) + 1, self.ps)
        }
        assert now <= set(self.model), "eviction created content"
        removed = [p for p in self.model if p not in now]
        assert len(removed) == freed
        for prefix in removed:
            assert self.alloc.is_free(self.model.pop(prefix)), "an evicted page is not free"
        for _, locked in self.held:
            for end in range(self.ps, len(locked) + 1, self.ps):
                assert locked[:end] in self.model, "a locked prefix was evicted"

    @invariant()
    def consistent(self) -> None:
        self.cache.check([h for h, _ in self.held])
        self.alloc.check()
        cached = self.cache.cached_pages()
        assert sorted(cached) == sorted(self.model.values())
        assert self.alloc.num_free + len(cached) == self.alloc.total, "a page leaked"
        assert self.cache.evictable_size + self.cache.protected_size == len(cached) * self.ps


TestRadix = RadixMachine.TestCase

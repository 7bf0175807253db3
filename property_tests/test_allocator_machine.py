"""Stateful test of the page allocator against a set model."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from compiled_engine.scheduler.allocator import PageAllocator


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(2, 40), page_size=st.sampled_from([1, 2, 16]))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.alloc = PageAllocator(num_pages, page_size)
        self.num_pages = num_pages
        self.owned: list[int] = []

    @rule(k=st.integers(1, 12))
    def alloc_pages(self, k: int) -> None:
        free_before = self.alloc.num_free
        pages = self.alloc.alloc(k)
        if k > free_before:
            assert pages is None and self.alloc.num_free == free_before
            return
        assert pages is not None and len(pages) == k
        assert PageAllocator.DUMMY_PAGE not in pages, "the dummy page was handed out"
        assert not set(pages) & set(self.owned), "a page handed out twice"
        assert all(1 <= p < self.num_pages for p in pages)
        self.owned.extend(pages)

    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        if not self.owned:
            return
        chosen = data.draw(st.lists(st.sampled_from(self.owned), unique=True, max_size=6))
        self.alloc.free(chosen)
        self.owned = [p for p in self.owned if p not in chosen]

    @rule(data=st.data())
    def double_free_rejected(self, data: st.DataObject) -> None:
        free = self.alloc.free_ids()
        if free:
            with pytest.raises(AssertionError):
                self.alloc.free([data.draw(st.sampled_from(free))])

    @invariant()
    def accounting(self) -> None:
        self.alloc.check()
        assert self.alloc.num_free + len(self.owned) == self.alloc.total == self.num_pages - 1
        assert not set(self.alloc.free_ids()) & set(self.owned)


TestAllocator = AllocatorMachine.TestCase

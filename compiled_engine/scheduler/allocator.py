"""O(1) id pools: KV pages (page 0 is the reserved dummy page) and table rows."""

from __future__ import annotations


class IdPool:
    """A LIFO free list of ids ``first .. n-1`` with double-free / foreign-id detection."""

    __slots__ = ("_free", "_is_free", "_first", "total")

    def __init__(self, n: int, first: int = 0) -> None:
        if n <= first:
            raise ValueError(f"pool needs more than {first} ids, got {n}")
        self._first = first
        self.total = n - first  # usable ids
        # Reversed so that ids are handed out in increasing order at start (readable plans).
        self._free = list(range(n - 1, first - 1, -1))
        self._is_free = bytearray(n)
        for i in range(first, n):
            self._is_free[i] = 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, k: int) -> list[int] | None:
        """``k`` ids, or None (nothing taken) if fewer than ``k`` are free."""
        free = self._free
        if k > len(free):
            return None
        if k == 1:
            out = [free.pop()]
        else:
            out = free[len(free) - k :]
            del free[len(free) - k :]
            out.reverse()
        is_free = self._is_free
        for i in out:
            is_free[i] = 0
        return out

    def alloc_one(self) -> int | None:
        if not self._free:
            return None
        i = self._free.pop()
        self._is_free[i] = 0
        return i

    def free(self, ids: list[int] | tuple[int, ...]) -> None:
        is_free = self._is_free
        for i in ids:
            if i < self._first or i >= len(is_free):
                raise AssertionError(
                    f"freeing id {i} outside the pool [{self._first}, {len(is_free)})"
                )
            if is_free[i]:
                raise AssertionError(f"double free of id {i}")
            is_free[i] = 1
        self._free.extend(reversed(ids))

    def is_free(self, i: int) -> bool:
        return bool(self._is_free[i])

    def free_ids(self) -> list[int]:
        return list(self._free)

    def check(self) -> None:
        assert len(set(self._free)) == len(self._free), "free list holds an id twice"
        assert sum(self._is_free) == len(self._free), "free mask disagrees with free list"
        assert all(self._is_free[i] for i in self._free), "free list holds an id marked used"
        assert all(not self._is_free[i] for i in range(self._first)), "a reserved id is free"


class PageAllocator(IdPool):
    """KV pages; raw slot of ``(page, offset)`` is ``page * page_size + offset``.

    Page 0 is reserved: its slots are the dummy slots that padding rows read.
    """

    __slots__ = ("page_size",)

    DUMMY_PAGE = 0

    def __init__(self, num_pages: int, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 2:
            raise ValueError(
                f"num_pages must be >= 2 (page 0 is the reserved dummy page), got {num_pages}"
            )
        super().__init__(num_pages, first=1)
        self.page_size = page_size

    @property
    def dummy_slot(self) -> int:
        return self.DUMMY_PAGE * self.page_size

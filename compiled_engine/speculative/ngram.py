"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of the
request's last n tokens, for the longest n in [min_n, max_n] that occurs. Each request keeps an
index of its n-grams, extended as its tokens grow, so a proposal costs O(max_n) lookups, not a
scan."""

from __future__ import annotations

from collections.abc import Sequence

from compiled_engine.scheduler.request import Request


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # n-gram -> the position after its latest occurrence that has a token following it
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        """Up to `k` tokens continuing the request's known tokens."""
        return self.lookup(req.tokens(), k)

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens continuing `tokens` (one request's tokens: they only ever grow)."""
        self._extend(tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            at = self._after.get(tuple(tokens[end - n :]))
            if at is not None:
                return tuple(tokens[at : at + k])
        return ()

    def _extend(self, tokens: Sequence[int]) -> None:
        for i in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._after[tuple(tokens[i - n : i])] = i
        self._indexed = max(self._indexed, len(tokens))

"""Page ownership for the paged KV pool. Pure Python over integers.

Invariant (checked by `check_integrity`): every page is either free or owned by exactly
one owner; free + used == total. An owner releases all its pages at once with `free`,
its single release path, so a request can never hand back a page it does not hold.
"""
from __future__ import annotations

from collections.abc import Hashable


class IntegrityError(AssertionError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.num_total = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._owner: dict[int, Hashable] = {}
        self._pages: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, owner: Hashable) -> list[int] | None:
        """Give `owner` n more pages, or None (and no change) if they are not free."""
        if n < 0:
            raise ValueError("page count must be >= 0")
        if n > len(self._free):
            return None
        got = [self._free.pop() for _ in range(n)]
        for p in got:
            self._owner[p] = owner
        self._pages.setdefault(owner, []).extend(got)
        return got

    def pages_of(self, owner: Hashable) -> list[int]:
        return list(self._pages.get(owner, ()))

    def owner_of(self, page: int) -> Hashable | None:
        return self._owner.get(page)

    def owners(self) -> list[Hashable]:
        return list(self._pages)

    def transfer(self, owner: Hashable, new_owner: Hashable) -> None:
        """Hand every page of `owner` to `new_owner` (e.g. into quarantine)."""
        pages = self._pages.pop(owner, [])
        for p in pages:
            self._owner[p] = new_owner
        if pages:
            self._pages.setdefault(new_owner, []).extend(pages)

    def free(self, owner: Hashable) -> int:
        """Return every page of `owner` to the pool; returns how many. Idempotent."""
        pages = self._pages.pop(owner, [])
        for p in pages:
            del self._owner[p]
        self._free.extend(reversed(pages))
        return len(pages)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a page is on the free list twice")
        owned = [p for pages in self._pages.values() for p in pages]
        if len(set(owned)) != len(owned):
            raise IntegrityError("a page is owned twice")
        if free & set(owned):
            raise IntegrityError("a page is both free and owned")
        if len(free) + len(owned) != self.num_total:
            raise IntegrityError(f"free {len(free)} + used {len(owned)} != total {self.num_total}")
        if set(self._owner) != set(owned) or any(self._owner[p] != o for o, ps in self._pages.items() for p in ps):
            raise IntegrityError("page owner index disagrees with owner page lists")

"""Page ownership for the paged KV pool. Pure Python over integers.

A page is free, or held by one or more holders (a request's choice, a room, a quarantine).
Holders that share pages form one owner group: the choices of a request of n > 1 choices
share its prompt's pages (`share`), and every page belongs to exactly one group while it
is used. A page's reference count is its number of holders; it returns to the free list
with its last reference. A shared page is never written: a holder that must write into
one first takes a private copy of it (`unshare`, copy-on-write).

Invariant (checked by `check_integrity`): every page is either free or used, never both;
free + used == total; every used page has at least one holder, its reference count equals
the number of holders whose page lists hold it, each of those holds it once, and all of
them are in the page's group. A holder releases all its references at once with `free`,
its single release path, so it can never hand back a page it does not hold.
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable


class IntegrityError(AssertionError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.num_total = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._holders: dict[int, list[Hashable]] = {}   # used page -> its holders (len = reference count)
        self._page_group: dict[int, int] = {}           # used page -> its owner group
        self._pages: dict[Hashable, list[int]] = {}      # holder -> its pages, in order
        self._group: dict[Hashable, int] = {}            # holder -> its owner group
        self._next_group = itertools.count()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free)

    def _group_of(self, owner: Hashable) -> int:
        group = self._group.get(owner)
        if group is None:
            group = self._group[owner] = next(self._next_group)
        return group

    def allocate(self, n: int, owner: Hashable) -> list[int] | None:
        """Give `owner` n more pages (in its group), or None (and no change) if they are not free."""
        if n < 0:
            raise ValueError("page count must be >= 0")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        group = self._group_of(owner)
        got = [self._free.pop() for _ in range(n)]
        for p in got:
            self._holders[p] = [owner]
            self._page_group[p] = group
        self._pages.setdefault(owner, []).extend(got)
        return got

    def share(self, owner: Hashable, new_owner: Hashable) -> list[int]:
        """`new_owner` (holding nothing yet) takes a reference to every page of `owner`, in
        order, and joins its group. Returns those pages."""
        if self._pages.get(new_owner):
            raise ValueError(f"{new_owner!r} already holds pages")
        pages = list(self._pages.get(owner, ()))
        if pages:
            for p in pages:
                self._holders[p].append(new_owner)
            self._pages[new_owner] = list(pages)
            self._group[new_owner] = self._group[owner]
        return pages

    def unshare(self, owner: Hashable, page: int) -> int | None:
        """Copy-on-write: `owner` trades its reference to the shared `page` for a free page
        of its own, at the same place in its page list. Returns the new page (the caller
        copies the contents), or None (and no change) if no page is free."""
        holders = self._holders.get(page)
        if holders is None or owner not in holders or len(holders) < 2:
            raise ValueError(f"page {page} is not shared by {owner!r}")
        if not self._free:
            return None
        new = self._free.pop()
        holders.remove(owner)
        self._holders[new] = [owner]
        self._page_group[new] = self._group[owner]
        pages = self._pages[owner]
        pages[pages.index(page)] = new
        return new

    def pages_of(self, owner: Hashable) -> list[int]:
        return list(self._pages.get(owner, ()))

    def refcount(self, page: int) -> int:
        """How many holders reference `page` (0: free)."""
        return len(self._holders.get(page, ()))

    def holders(self, page: int) -> list[Hashable]:
        return list(self._holders.get(page, ()))

    def owner_of(self, page: int) -> Hashable | None:
        """The page's only holder; None if it is free or shared."""
        holders = self._holders.get(page, ())
        return holders[0] if len(holders) == 1 else None

    def owners(self) -> list[Hashable]:
        return list(self._pages)

    def transfer(self, owner: Hashable, new_owner: Hashable) -> None:
        """Hand every reference of `owner` to `new_owner` (e.g. into quarantine), which
        takes `owner`'s place in the group."""
        pages = self._pages.pop(owner, [])
        group = self._group.pop(owner, None)
        if not pages:
            return
        if self._pages.get(new_owner) and self._group[new_owner] != group:
            raise ValueError(f"{new_owner!r} holds pages of another owner group")
        for p in pages:
            holders = self._holders[p]
            holders[holders.index(owner)] = new_owner
        self._pages.setdefault(new_owner, []).extend(pages)
        self._group[new_owner] = group

    def free(self, owner: Hashable) -> int:
        """Drop every reference `owner` holds; a page returns to the pool with its last
        reference. Returns how many references were dropped. Idempotent."""
        pages = self._pages.pop(owner, [])
        self._group.pop(owner, None)
        released = []
        for p in pages:
            holders = self._holders[p]
            holders.remove(owner)
            if not holders:
                del self._holders[p]
                del self._page_group[p]
                released.append(p)
        self._free.extend(reversed(released))
        return len(pages)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a page is on the free list twice")
        used = set(self._holders)
        if free & used:
            raise IntegrityError("a page is both free and used")
        if len(free) + len(used) != self.num_total:
            raise IntegrityError(f"free {len(free)} + used {len(used)} != total {self.num_total}")
        if set(self._page_group) != used:
            raise IntegrityError("a used page has no owner group, or a free page has one")
        refs: dict[int, int] = {}
        for owner, pages in self._pages.items():
            if not pages:
                raise IntegrityError(f"{owner!r} is listed with no page")
            if len(set(pages)) != len(pages):
                raise IntegrityError(f"{owner!r} holds a page twice")
            group = self._group.get(owner)
            for p in pages:
                refs[p] = refs.get(p, 0) + 1
                if owner not in self._holders.get(p, ()):
                    raise IntegrityError(f"page {p} of {owner!r} does not list it as a holder")
                if self._page_group[p] != group:
                    raise IntegrityError(f"page {p} is held by {owner!r} outside its owner group")
        for p, holders in self._holders.items():
            if not holders or len(holders) != refs.get(p, 0) or len(set(holders)) != len(holders):
                raise IntegrityError(f"page {p}: reference count {len(holders)} != {refs.get(p, 0)} holders")
        if set(self._group) != set(self._pages):
            raise IntegrityError("owner group index disagrees with the holders")

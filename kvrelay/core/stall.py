"""A judge's own stalls: what a loop that judges liveness could not have observed.

A loop that holds peers under leases (the router's reaper, a worker's P<->D leases) can
only notice a peer's answers while it runs. When the loop itself stalls (its thread off
the CPU, a long synchronous call, a paused process), the answers wait unread, and a lease
judged by the wall clock alone would count the judge's stall against every peer at once.

`StallWatch.look()` is called each time the loop looks (once per reaper pass, per
scheduler iteration). A gap between two looks longer than `tolerance` is a stall of the
excess: the judge was blind from `tolerance` after its previous look until this one.

Invariants:
- `blind(since)` is the total stall time recorded after `since`, so a lease silent since
  `since` has lasted `now - since - blind(since)` seconds of the judge's own looking; a
  stall of the judge never shortens a peer's lease, it extends it by the stall.
- Stalls older than `horizon` are forgotten: a lease longer than that counts them again.
- Everything reads the injected clock: the simulation's SimClock moves it.
"""
from __future__ import annotations

import logging
from collections import deque

from kvrelay.core.clock import Clock

log = logging.getLogger("kvrelay.stall")


class StallWatch:
    def __init__(self, clock: Clock, tolerance: float, horizon: float, name: str = "loop") -> None:
        self.clock, self.tolerance, self.horizon, self.name = clock, tolerance, horizon, name
        self._last = clock.now()
        self._stalls: deque[tuple[float, float]] = deque()   # (start, end), oldest first
        self.count = 0          # stalls seen since start
        self.seconds = 0.0      # their total length

    def look(self) -> float:
        """Record this look; returns the stall it ended (0.0 for none)."""
        now = self.clock.now()
        start = self._last + self.tolerance
        self._last = now
        while self._stalls and self._stalls[0][1] < now - self.horizon:
            self._stalls.popleft()
        if now <= start:
            return 0.0
        self._stalls.append((start, now))
        self.count += 1
        self.seconds += now - start
        level = logging.WARNING if now - start >= self.tolerance else logging.INFO
        log.log(level, "loop stalled", extra={"loop": self.name, "seconds": round(now - start, 3),
                                              "tolerance": self.tolerance})
        return now - start

    def blind(self, since: float) -> float:
        """Seconds of recorded stalls after `since`."""
        return sum(end - max(start, since) for start, end in self._stalls if end > since)

    def silent(self, since: float) -> float:
        """Seconds of the judge's own looking since `since` (the wall time less its stalls)."""
        return self.clock.now() - since - self.blind(since)

"""Monotonic clocks. Every deadline in kvrelay reads one of these, never wall time."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod


class Clock(ABC):
    """A monotonic source of seconds. `now()` never goes backwards."""

    @abstractmethod
    def now(self) -> float: ...


class MonotonicClock(Clock):
    def now(self) -> float:
        return time.monotonic()


class SimClock(Clock):
    """A clock that moves only when a test advances it."""

    def __init__(self, start: float = 1000.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go backwards")
        self._t += seconds

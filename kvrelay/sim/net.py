"""The simulated network between workers' control endpoints.

`SimChannel` is a `disagg.channel.Channel`: frames are built and checked by the same
`_parts`/`_open` code as the zmq channel (wire encoding, optional cluster-key seal), so
everything above the channel is production code. `SimNetwork` decides when, whether and
how often each frame arrives, per link (src -> dst), from the seeded RNG it is given:

    latency     every frame takes base + jitter seconds (jitter drawn per frame)
    in order    a link delivers in send order (like one TCP connection), unless reorder
    drop        a frame is lost with probability p
    dup         a frame arrives twice with probability p
    reorder     a frame may overtake the ones sent before it
    partition   nothing crosses the link (both ways) until healed
    rate        the link carries data frames (KV bytes) at this many bytes a second, in
                order: a frame leaves only after the ones before it, and control messages
                queue behind them, as on one slow TCP connection (control bytes are free)

A channel that is closed (its worker crashed) receives nothing; frames in flight to its
address are lost, and a new incarnation bound at the same address does not get them.

The network remembers, per (src, dst, room), when the latest `Notice` sent over that link
arrives (`notices`: its arrival times, empty when it was lost), so that the peer-end
invariant judges a notice by what happened to it, not by the link's state at some later
moment.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Sequence

from kvrelay.disagg import wire
from kvrelay.disagg.channel import Channel, Frame, Received


@dataclass
class LinkFaults:
    drop: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    extra_delay: float = 0.0     # seconds added to every frame's latency
    down: bool = False           # partitioned
    rate: float = 0.0            # data bytes a second (0: no limit)


@dataclass(order=True)
class _InFlight:
    at: float
    seq: int
    bound: int = field(compare=False)     # the receiving channel's bind number
    parts: list = field(compare=False)


class SimNetwork:
    def __init__(self, clock, rng: random.Random, base_latency: float = 0.0005, jitter: float = 0.0005) -> None:
        self.clock, self.rng = clock, rng
        self.base_latency, self.jitter = base_latency, jitter
        self.channels: dict[str, "SimChannel"] = {}
        self.links: dict[tuple[str, str], LinkFaults] = {}
        self.pools: dict[str, memoryview] = {}     # the fake backend's pool registry
        self._queues: dict[str, list[_InFlight]] = {}
        self._last: dict[tuple[str, str], float] = {}   # link -> latest delivery time (in order)
        self.notices: dict[tuple[str, str, int], list[float]] = {}   # (src, dst, room) -> arrivals of the last Notice
        self._seq = 0
        self._binds = 0
        self.sent = self.dropped = 0

    def channel(self, address: str) -> "SimChannel":
        if address in self.channels:
            raise ValueError(f"address {address} already bound")
        self._binds += 1
        ch = SimChannel(self, address, self._binds)
        self.channels[address] = ch
        self._queues[address] = []
        return ch

    def link(self, src: str, dst: str) -> LinkFaults:
        return self.links.setdefault((src, dst), LinkFaults())

    def partition(self, a: str, b: str, down: bool) -> None:
        self.link(a, b).down = self.link(b, a).down = down

    def deliver(self, src: str, dst: str, parts: list, data_bytes: int = 0) -> list[float] | None:
        """When each copy of the frame arrives: [] when it is lost on the way (the sender
        cannot tell), None when nobody is bound at `dst` (like a connection refused)."""
        target = self.channels.get(dst)
        if target is None:
            return None
        self.sent += 1
        faults = self.links.get((src, dst))
        if faults is not None and (faults.down or (faults.drop and self.rng.random() < faults.drop)):
            self.dropped += 1
            return []
        copies = 2 if faults is not None and faults.dup and self.rng.random() < faults.dup else 1
        arrivals = []
        for _ in range(copies):
            at = self.clock.now() + self.base_latency + self.rng.random() * self.jitter
            if faults is not None:
                at += faults.extra_delay
            if faults is not None and faults.rate:
                at = max(at, self._last.get((src, dst), 0.0)) + data_bytes / faults.rate
                self._last[(src, dst)] = at
            elif faults is None or not (faults.reorder and self.rng.random() < faults.reorder):
                at = max(at, self._last.get((src, dst), 0.0))
                self._last[(src, dst)] = at
            self._seq += 1
            heapq.heappush(self._queues[dst], _InFlight(at, self._seq, target.bound, parts))
            arrivals.append(at)
        return arrivals

    def arrived(self, ch: "SimChannel", max_n: int) -> list[list]:
        q, now, out = self._queues.get(ch.address, []), self.clock.now(), []
        while q and q[0].at <= now and len(out) < max_n:
            item = heapq.heappop(q)
            if item.bound == ch.bound:
                out.append(item.parts)
        return out

    def next_arrival(self) -> float | None:
        times = [q[0].at for q in self._queues.values() if q]
        return min(times) if times else None

    def unbind(self, ch: "SimChannel") -> None:
        if self.channels.get(ch.address) is ch:
            del self.channels[ch.address]
            self._queues[ch.address] = []   # in flight to a dead process: lost
            # ... so nothing is ahead of the frames of a new incarnation's connections
            for link in [k for k in self._last if ch.address in k]:
                del self._last[link]


class SimChannel(Channel):
    def __init__(self, network: SimNetwork, address: str, bound: int) -> None:
        self.network, self.address, self.bound = network, address, bound
        self.closed = False

    def send(self, dst: str, msg: wire.Message, frames: Sequence[Frame] = ()) -> bool:
        if self.closed:
            return False
        arrivals = self.network.deliver(self.address, dst, [bytes(p) for p in self._parts(dst, msg, frames)],
                                        sum(len(memoryview(f)) for f in frames))
        if isinstance(msg, wire.Notice) and arrivals is not None:
            self.network.notices[(self.address, dst, msg.room)] = arrivals
        return arrivals is not None

    def recv(self, max_n: int = 10_000) -> list[Received]:
        if self.closed:
            return []
        out = []
        for parts in self.network.arrived(self, max_n):
            got = self._open(parts, ("tcp",))
            if got is not None:
                out.append(got)
        return out

    def close(self) -> None:
        self.closed = True
        self.network.unbind(self)

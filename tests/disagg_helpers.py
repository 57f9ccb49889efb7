"""Shared fixtures for the transfer/lifecycle tests: a P and a D coordinator in one process
on a chosen backend, a simulated clock for every deadline, and leak checks.

Backends under test: env KVRELAY_TEST_BACKENDS (comma list), default every registered
backend whose module imports.
"""
from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager
from dataclasses import replace

from kvrelay.core.clock import SimClock
from kvrelay.core.config import LifecycleConfig, TransferConfig
from kvrelay.core.kvlayout import KVLayout
from kvrelay.disagg import wire
from kvrelay.disagg.auth import ChannelAuth
from kvrelay.disagg.channel import InProcNetwork
from kvrelay.disagg.decode_side import DecodeSide
from kvrelay.disagg.faults import FaultSpec
from kvrelay.disagg.prefill_side import PrefillSide
from kvrelay.disagg.transfer import TRANSFER_BACKENDS, create_manager
from kvrelay.disagg.transfer.base import host_pool
from kvrelay.engine.allocator import PageAllocator

LAYOUT = KVLayout("test-model", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=16)  # 2 KiB pages

CFG = LifecycleConfig(heartbeat_interval=1.0, heartbeat_misses=3, bootstrap_timeout=5.0,
                      queue_timeout=8.0, waiting_timeout=9.0, transfer_timeout=4.0,
                      max_request_time=None, quarantine_grace=2.0)
DT = 0.05  # simulated seconds per scheduler iteration
# Simulated seconds a frame may spend in a real socket: the harness sleeps 1 ms of real time per
# step, so a 20 ms stall of this machine is 20 steps. Below the lease minus a heartbeat, so a
# bound with it still tells a heartbeat's answer from the lease's.
DELIVERY = 1.0


def backends_under_test() -> list[str]:
    env = os.environ.get("KVRELAY_TEST_BACKENDS")
    if env:
        return [b.strip() for b in env.split(",") if b.strip()]
    names = []
    for name in TRANSFER_BACKENDS.names():
        try:
            backend = TRANSFER_BACKENDS.get(name)
        except Exception:  # noqa: BLE001 - a backend whose module does not import is not tested
            continue
        if "cpu" in backend.memory:   # host pools here; a device backend runs in tests/test_gpu.py
            names.append(name)
    return names


BACKENDS = backends_under_test()


@contextmanager
def opened(backend: str, **kw):
    """A manager of `backend` in LAYOUT, closed on the way out (kw: create_manager's)."""
    m = create_manager(backend, LAYOUT, TransferConfig(transfer_backend=backend), **kw)
    try:
        yield m
    finally:
        m.close()


def pattern(seed: int, nbytes: int) -> bytes:
    out = b""
    i = 0
    while len(out) < nbytes:
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest()
        i += 1
    return out[:nbytes]


def checksum(buf) -> str:
    return hashlib.sha256(bytes(buf)).hexdigest()


class Harness:
    """P and D coordinators on one backend, stepped together on a SimClock."""

    def __init__(self, backend: str, cfg: LifecycleConfig = CFG, *, p_faults: str | None = None,
                 d_faults: str | None = None, num_pages: int = 16, key: bytes | None = None) -> None:
        """`key`: a cluster key's control derivation; both sides then seal every frame."""
        self.backend, self.cfg, self.num_pages, self.key = backend, cfg, num_pages, key
        self.clock = SimClock()
        self.real = not backend.startswith("fake")
        self.network = None if self.real else InProcNetwork()
        self.pm = self._manager(p_faults)
        self.dm = self._manager(d_faults)
        self.ppool = host_pool(self.pm, num_pages)
        self.dpool = host_pool(self.dm, num_pages)
        self.palloc, self.dalloc = PageAllocator(num_pages), PageAllocator(num_pages)
        self.epoch = 0
        self.events: list[tuple[float, object]] = []   # (sim time, TerminalEvent)
        self.p_released: dict[int, int] = {}
        self.d_released: dict[int, int] = {}
        self.P = self._prefill_side()
        self.D = self._decode_side()

    # ---- construction ---------------------------------------------------------------------
    def _manager(self, faults: str | None, port: int = 0):
        tcfg = TransferConfig(transfer_backend=self.backend, transfer_port=port, fault_spec=faults)
        kw = {} if self.real else {"network": self.network}
        if self.key is not None:
            kw["auth"] = ChannelAuth(self.key)
        return create_manager(self.backend, LAYOUT, tcfg, lifecycle=self.cfg, clock=self.clock, **kw)

    def _prefill_side(self) -> PrefillSide:
        return PrefillSide(self.cfg, self.pm, self.clock, self._p_release, on_terminal=self._record)

    def _decode_side(self) -> DecodeSide:
        return DecodeSide(self.cfg, self.dm, self.clock, self._reserve, self._d_release,
                          on_terminal=self._record, capacity=self.num_pages)

    def _record(self, ev) -> None:
        self.events.append((self.clock.now(), ev))

    def _reserve(self, room: int, n: int):
        pages = self.dalloc.allocate(n, room)
        if pages is None:
            return None
        self.epoch += 1
        return pages, self.epoch

    def _d_release(self, room: int, pages: list[int]) -> None:
        self.d_released[room] = self.d_released.get(room, 0) + 1
        assert sorted(self.dalloc.pages_of(room)) == sorted(pages)
        self.dalloc.free(room)

    def _p_release(self, room: int) -> None:
        self.p_released[room] = self.p_released.get(room, 0) + 1
        self.palloc.free(room)

    def set_faults(self, side: str, spec: str) -> None:
        (self.pm if side == "P" else self.dm).faults.spec = FaultSpec.parse(spec)

    # ---- driving ------------------------------------------------------------------------------
    def request(self, room: int, n_pages: int = 2, *, on_p: bool = True, on_d: bool = True) -> None:
        if on_p:
            self.P.add(room, f"rid-{room}")
        if on_d:
            self.D.add(room, f"rid-{room}", self.pm.address, n_pages)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.clock.advance(DT)
            self.P.step()
            self.D.step()
            if self.real:
                time.sleep(0.001)  # let sockets deliver; deadlines read only the SimClock

    def run_until(self, pred, max_seconds: float = 60.0) -> bool:
        """Step until pred() holds, at most max_seconds of simulated time."""
        for _ in range(int(max_seconds / DT)):
            if pred():
                return True
            self.step()
        return pred()

    def phase(self, side: str, room: int) -> str | None:
        lc = (self.P if side == "P" else self.D).lc
        r = lc.rooms.get(room)
        return None if r is None else r.phase.name.lower()

    def event(self, side: str, room: int):
        name = "prefill" if side == "P" else "decode"
        for t, ev in self.events:
            if ev.side == name and ev.room == room:
                return t, ev
        return None

    def prefill(self, room: int, seed: int | None = None) -> list[int]:
        """Run the 'engine' for a queued room: take it, fill its pages, hand them over."""
        assert self.run_until(lambda: self.phase("P", room) in ("queued", "prefill"), 10), self.events
        self.P.take_queued(1_000)
        assert self.phase("P", room) == "prefill"
        n = len(self.P._senders[room].dest.dst_pages)
        pages = self.palloc.allocate(n, room)
        pb = LAYOUT.page_bytes
        data = pattern(room if seed is None else seed, n * pb)
        for i, p in enumerate(pages):
            self.ppool[p * pb:(p + 1) * pb] = data[i * pb:(i + 1) * pb]
        self.P.prefill_done(room, pages, wire.Aux(0, 0, first_token=7, logprob=-0.25, prompt_tokens=n * 4))
        return pages

    def to_phase(self, room: int, side: str, phase: str, max_seconds: float = 10.0) -> None:
        assert self.run_until(lambda: self.phase(side, room) == phase, max_seconds), \
            (side, room, self.phase(side, room), phase, self.events)

    def d_pages(self, pages) -> bytes:
        pb = LAYOUT.page_bytes
        return b"".join(bytes(self.dpool[p * pb:(p + 1) * pb]) for p in pages)

    def complete(self, room: int, n_pages: int = 2) -> None:
        """Drive one request through the happy path to done on both sides."""
        self.to_phase(room, "P", "queued")
        self.prefill(room)
        assert self.run_until(lambda: room in [r for r, _ in self.D.take_ready()] or
                              self.phase("D", room) == "decode")
        self.D.finish(room)
        assert self.run_until(lambda: self.phase("P", room) is None)

    # ---- checks -----------------------------------------------------------------------------
    def settle(self, max_seconds: float | None = None) -> None:
        limit = max_seconds or (self.cfg.transfer_timeout + self.cfg.quarantine_grace + 10 * DT + 5)
        assert self.run_until(lambda: self.P.idle() and self.D.idle(), limit), (self.P.live(), self.D.live())
        self.step(5)  # let late notices/acks drain

    def assert_no_leak(self) -> None:
        self.settle()
        for alloc in (self.palloc, self.dalloc):
            alloc.check_integrity()
            assert alloc.num_free == alloc.num_total
        for side in (self.P, self.D):
            assert all(n == 0 for n in side.phase_counts().values()), side.phase_counts()
            assert side.oldest_age() == 0.0 and side.live() == []
        assert not self.D.quarantine
        for m in (self.pm, self.dm):
            c = m.counts()
            assert c["senders"] == c["receivers"] == c["owned_pages"] == 0, c
        for room, n in list(self.p_released.items()) + list(self.d_released.items()):
            assert n == 1, f"room {room} released {n} times"

    def _reincarnate(self, old) -> object:
        """Close a manager and start a new incarnation at the same control address."""
        address = old.address
        old.close()
        if self.real:
            new = self._manager(None, port=int(address.rsplit(":", 1)[1]))
            time.sleep(0.1)  # real sockets reconnect in real time; the SimClock waits for them
        else:
            auth = {"auth": ChannelAuth(self.key)} if self.key is not None else {}
            new = create_manager(self.backend, LAYOUT, TransferConfig(transfer_backend=self.backend),
                                 lifecycle=self.cfg, clock=self.clock, channel=self.network.channel(address), **auth)
        assert new.address == address
        return new

    def restart_p(self) -> None:
        """Replace P by a new incarnation at the same control address."""
        self.pm = self._reincarnate(self.pm)
        self.ppool = host_pool(self.pm, self.num_pages)
        self.palloc = PageAllocator(self.num_pages)
        self.p_released = {}
        self.P = self._prefill_side()

    def restart_d(self) -> None:
        """Replace D by a new incarnation at the same control address (new pool, new pages)."""
        self.dm = self._reincarnate(self.dm)
        self.dpool = host_pool(self.dm, self.num_pages)
        self.dalloc = PageAllocator(self.num_pages)
        self.d_released = {}
        self.D = self._decode_side()

    def close(self) -> None:
        self.pm.close()
        self.dm.close()


def with_cfg(**kw) -> LifecycleConfig:
    return replace(CFG, **kw)

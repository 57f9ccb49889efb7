"""Fault injection for the transfer layer, deterministic given a seed.

Spec syntax (`--fault-spec` or env KVRELAY_FAULTS): `key=value` pairs joined by `;`
    drop_ctrl=P       drop each control message with probability P
    delay_ctrl=S      hold each control message S seconds (on the manager's clock)
    dup_ctrl=P        send each control message twice with probability P
    reorder_ctrl=P    with probability P, hold a message until after the next one
    drop_ack=P        drop Ack messages (P=1: never acknowledge)
    drop_heartbeat=P  drop Heartbeat messages (P=1: look dead to the peer)
    drop:<Kind>=P     drop messages of one wire kind, e.g. drop:Destination=1
    hang_transfer=P   a data write never completes (and never confirms it stopped)
    fail_transfer=P   a data write fails
    ignore_aux=P      (decode side) ignore an arriving Aux: the transfer never completes here,
                      so this worker never acknowledges it (the stuck-inflight scenario)
    seed=N            RNG seed (default 0)
Faults act on what THIS worker sends (ignore_aux: on what it receives); data frames (messages carrying raw frames) are never
touched by the control-message faults. Unknown keys are an error, so a typo fails loudly.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Sequence

from kvrelay.core.clock import Clock, MonotonicClock
from kvrelay.disagg import wire
from kvrelay.disagg.channel import Channel, Frame, Received

_KEYS = ("drop_ctrl", "delay_ctrl", "dup_ctrl", "reorder_ctrl", "drop_ack", "drop_heartbeat",
         "hang_transfer", "fail_transfer", "ignore_aux")


@dataclass(frozen=True)
class FaultSpec:
    drop_ctrl: float = 0.0
    delay_ctrl: float = 0.0
    dup_ctrl: float = 0.0
    reorder_ctrl: float = 0.0
    drop_ack: float = 0.0
    drop_heartbeat: float = 0.0
    hang_transfer: float = 0.0
    fail_transfer: float = 0.0
    ignore_aux: float = 0.0
    drop_kinds: dict = field(default_factory=dict)  # {wire kind: probability}
    seed: int = 0

    @classmethod
    def parse(cls, spec: str | None) -> "FaultSpec":
        if not spec:
            return cls()
        values: dict = {}
        kinds: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in spec.split(";"))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"fault spec item {item!r} is not key=value")
            if key == "seed":
                values["seed"] = int(raw)
            elif key.startswith("drop:"):
                kinds[key[5:]] = float(raw)
            elif key in _KEYS:
                values[key] = float(raw)
            else:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(_KEYS)}, drop:<Kind>, seed")
        return cls(drop_kinds=kinds, **values)

    @classmethod
    def from_config(cls, fault_spec: str | None) -> "FaultSpec":
        """The flag wins; otherwise KVRELAY_FAULTS."""
        return cls.parse(fault_spec if fault_spec else os.environ.get("KVRELAY_FAULTS"))

    @property
    def any_ctrl(self) -> bool:
        return any((self.drop_ctrl, self.delay_ctrl, self.dup_ctrl, self.reorder_ctrl,
                    self.drop_ack, self.drop_heartbeat, self.drop_kinds))

    @property
    def any(self) -> bool:
        return self.any_ctrl or bool(self.hang_transfer or self.fail_transfer or self.ignore_aux)


class Faults:
    """The seeded RNG behind one worker's faults; `spec` may be replaced mid-run (tests
    switch a fault on after the request is under way)."""

    def __init__(self, spec: FaultSpec | None = None) -> None:
        self.spec = spec or FaultSpec()
        self.rng = random.Random(self.spec.seed)

    def hit(self, p: float) -> bool:
        return p >= 1.0 or (p > 0.0 and self.rng.random() < p)

    def transfer_fault(self) -> str | None:
        """Data-path hook, called once per write a backend starts: None, "hang" or "fail"."""
        if self.hit(self.spec.hang_transfer):
            return "hang"
        if self.hit(self.spec.fail_transfer):
            return "fail"
        return None

    def drops(self, msg: wire.Message) -> bool:
        s = self.spec
        if isinstance(msg, wire.Ack) and self.hit(s.drop_ack):
            return True
        if isinstance(msg, wire.Heartbeat) and self.hit(s.drop_heartbeat):
            return True
        return self.hit(s.drop_kinds.get(msg.KIND, 0.0)) or self.hit(s.drop_ctrl)


class FaultyChannel(Channel):
    """Wraps a channel and misbehaves on control messages per the spec. Held messages
    (delay, reorder) are released on the next send() or recv() once due."""

    def __init__(self, inner: Channel, faults: Faults, clock: Clock | None = None) -> None:
        self.inner = inner
        self.faults = faults
        self.clock = clock or MonotonicClock()
        self.address = inner.address
        self._held: list[tuple[float, str, wire.Message]] = []  # (due, dst, msg)
        self._reorder: tuple[str, wire.Message] | None = None

    def send(self, dst: str, msg: wire.Message, frames: Sequence[Frame] = ()) -> bool:
        self._flush()
        if frames:
            return self.inner.send(dst, msg, frames)
        f, s = self.faults, self.faults.spec
        if f.drops(msg):
            return True  # a lost message looks sent to the sender
        copies = 2 if f.hit(s.dup_ctrl) else 1
        for _ in range(copies):
            if s.delay_ctrl > 0:
                self._held.append((self.clock.now() + s.delay_ctrl, dst, msg))
            elif self._reorder is None and f.hit(s.reorder_ctrl):
                self._reorder = (dst, msg)
            else:
                self.inner.send(dst, msg)
                self._release_reordered()
        return True

    def _release_reordered(self) -> None:
        if self._reorder is not None:
            dst, msg = self._reorder
            self._reorder = None
            self.inner.send(dst, msg)

    def _flush(self) -> None:
        now = self.clock.now()
        due = [h for h in self._held if h[0] <= now]
        if due:
            self._held = [h for h in self._held if h[0] > now]
            for _, dst, msg in due:
                self.inner.send(dst, msg)

    def recv(self, max_n: int = 10_000) -> list[Received]:
        self._flush()
        self._release_reordered()  # a held message never waits more than one iteration
        return self.inner.recv(max_n)

    def forget(self, dst: str) -> None:
        self.inner.forget(dst)

    def close(self) -> None:
        self._held.clear()
        self._reorder = None
        self.inner.close()

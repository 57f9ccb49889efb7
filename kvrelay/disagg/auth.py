"""Authentication of every frame on the P<->D control channel with the cluster key.

With a cluster key, a channel sends each message as [auth, header, *data] and accepts
only messages whose auth frame proves that a holder of the key sent exactly this header
and data frames of exactly these lengths, recently, and once. The auth frame is
AUTH_BYTES bytes:

    magic "KVA1" | boot u64 | counter u64 | time u64 | sender id 8 bytes | mac 32 bytes

    boot     the sending channel's start, ms since the epoch (orders its incarnations)
    counter  grows by one per message the channel seals (any destination)
    time     when it was sealed, ms since the epoch
    mac      HMAC-SHA256 under the key's "control" derivation over everything before it,
             the destination address, the header, and the length of every data frame
             (so a message sealed for one worker is refused by every other)

Checks, in order, each failure a reason code of kvrelay_rejected_input_total (surface
"control"); the header is parsed only after the first three pass:
    no_auth          no auth frame (a sender without the key)
    bad_auth         the mac does not match (another key, or altered in flight)
    stale            `time` is more than --replay-window seconds from this host's clock
    old_incarnation  `src` has already sent under a later (boot, sender id); accepted
                     again only after that one stayed silent for a whole replay window
                     (a peer host whose clock stepped back is locked out that long)
    replay           this (src, boot, sender id, counter) was accepted before, or lies
                     more than WINDOW counters behind the highest one accepted

What this does not cover (docs/security.md): the bytes of data frames are bound by length,
not by content, so an attacker on the path who can rewrite TCP segments could alter KV
bytes in flight (use an encrypted network for that); a holder of the key is trusted.
Channels without a key send and accept plain [header, *data], and drop auth frames
("auth_not_configured"): a cluster is either keyed throughout or not at all.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from kvrelay.core import ids

MAGIC = b"KVA1"
_PREFIX = struct.Struct("!4sQQQ8s")
MAC_BYTES = 32
AUTH_BYTES = _PREFIX.size + MAC_BYTES
WINDOW = 1024          # counters behind the highest accepted one that may still arrive once
MAX_SENDERS = 4096     # replay state kept per sender address (least recently heard evicted)


class AuthError(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Stamp:
    """What a verified auth frame says about its sender."""
    boot: int
    sender: bytes
    counter: int


@dataclass
class _Seen:
    boot: int
    sender: bytes
    high: int          # highest counter accepted
    mask: int          # bit i: counter high - i was accepted
    heard: float       # wall time of the last accepted message


def _mac(key: bytes, prefix: bytes, dst: str, header: bytes, frames: Sequence) -> bytes:
    h = hmac.new(key, prefix, hashlib.sha256)
    h.update(dst.encode() + b"\0")
    h.update(header)
    h.update(struct.pack(f"!{len(frames)}Q", *(memoryview(f).nbytes for f in frames)))
    return h.digest()


class ChannelAuth:
    """One channel's sealing state and its replay state per sender. `key` is the cluster
    key's control derivation; `wall` returns seconds since the epoch (injectable)."""

    def __init__(self, key: bytes, replay_window: float = 60.0, *,
                 wall: Callable[[], float] = time.time) -> None:
        self._key = key
        self._wall = wall
        self.replay_window = replay_window
        self.boot = int(wall() * 1000)
        self.sender = bytes.fromhex(ids.token_hex(8))
        self._counter = 0
        self._seen: OrderedDict[str, _Seen] = OrderedDict()

    def seal(self, dst: str, header: bytes, frames: Sequence = ()) -> bytes:
        """The auth frame to send to `dst` before `header` and `frames`."""
        self._counter += 1
        prefix = _PREFIX.pack(MAGIC, self.boot, self._counter, int(self._wall() * 1000), self.sender)
        return prefix + _mac(self._key, prefix, dst, header, frames)

    def verify(self, dst: str, auth: bytes | None, header: bytes, frames: Sequence = ()) -> Stamp:
        """Check a message that arrived at `dst` (this channel's own address). Raises
        AuthError(no_auth | bad_auth | stale); the header is still unparsed."""
        if auth is None or len(auth) != AUTH_BYTES or auth[:4] != MAGIC:
            raise AuthError("no_auth")
        prefix = auth[:_PREFIX.size]
        if not hmac.compare_digest(auth[_PREFIX.size:], _mac(self._key, prefix, dst, header, frames)):
            raise AuthError("bad_auth")
        _, boot, counter, sent_ms, sender = _PREFIX.unpack(prefix)
        if abs(sent_ms / 1000 - self._wall()) > self.replay_window:
            raise AuthError("stale")
        return Stamp(boot, sender, counter)

    def accept(self, src: str, stamp: Stamp) -> str | None:
        """Record a verified message from `src`; -> None, or the reason it is refused
        (old_incarnation, replay). Call only after `verify` and after `src` was decoded
        from the authenticated header."""
        now = self._wall()
        seen = self._seen.get(src)
        who = (stamp.boot, stamp.sender)
        if seen is not None and who != (seen.boot, seen.sender):
            if who < (seen.boot, seen.sender) and now - seen.heard <= self.replay_window:
                return "old_incarnation"
            seen = None   # a new incarnation of src (or the old one outlived a silent window)
        if seen is None:
            self._seen[src] = _Seen(stamp.boot, stamp.sender, stamp.counter, 1, now)
            self._seen.move_to_end(src)
            while len(self._seen) > MAX_SENDERS:
                self._seen.popitem(last=False)
            return None
        if stamp.counter > seen.high:
            seen.mask = ((seen.mask << (stamp.counter - seen.high)) | 1) & ((1 << WINDOW) - 1)
            seen.high = stamp.counter
        else:
            behind = seen.high - stamp.counter
            if behind >= WINDOW or (seen.mask >> behind) & 1:
                return "replay"
            seen.mask |= 1 << behind
        seen.heard = now
        self._seen.move_to_end(src)
        return None

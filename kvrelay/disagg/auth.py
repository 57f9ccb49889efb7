"""Authentication of every frame on the P<->D control channel with the cluster key.

With a cluster key, a channel sends each message as [auth, header, *data] and accepts
only messages whose auth frame proves that a holder of the key sent exactly this header
and data frames of exactly these lengths, recently, once, and to this incarnation of this
receiver. (Before any frame, the zmq handshake already refused peers without the key:
disagg.channel.) The auth frame is AUTH_BYTES (84) bytes:

    magic "KVA2" | boot u64 | counter u64 | time u64 | sender id 8 bytes
                 | rx boot u64 | rx sender id 8 bytes | gate mac 16 | header mac 16

    boot, sender id   the sending channel's incarnation: its start, ms since the epoch
                      (orders incarnations), and a random id
    counter           grows by one per message the channel seals (any destination)
    time              when it was sealed, ms since the epoch
    rx boot, rx id    the incarnation of the receiver this was sealed for: the last one the
                      sender accepted a message from at that address; zero before it has
                      accepted any (first contact)
    gate mac          HMAC-SHA256 under the key's "control" derivation over "gate", the
                      prefix (everything before it), the destination address, the header's
                      length and every data frame's length, truncated to 16 bytes
    header mac        HMAC-SHA256 under the same key over "header", the gate mac and the
                      header bytes, truncated to 16 bytes

Two macs so that what a frame costs before it is known to come from a key holder does not
grow with the frame: the gate covers a fixed-size prefix and a few lengths, and only a
frame that passes it gets its header (up to wire.MAX_FRAME_BYTES) hashed. The header mac
covers the gate mac, so it binds everything the gate binds. 128-bit tags (RFC 2104's
truncation) leave a forger one chance in 2**128 per try.

Checks, in order, each failure a reason code of kvrelay_rejected_input_total (surface
"control"); the header is parsed only after every check of `verify` passed, and nothing is
hashed before the cheap ones (the first five) passed:
    no_auth            no auth frame of this version and size (a sender without the key)
    too_large          the header is longer than wire.MAX_FRAME_BYTES
    stale              `time` is more than --replay-window seconds from this host's clock
    before_boot        a first-contact frame sealed more than BOOT_SLACK before this
                       receiver started (captured from an earlier incarnation at this address)
    replay             (boot, sender id, counter) was accepted before, or lies more than
                       WINDOW counters behind the highest one accepted; judged from the
                       cleartext before hashing, and again after the header is parsed
    bad_auth           a mac does not match (another key, or altered in flight)
    other_incarnation  sealed for another incarnation of this receiver (sent to a worker
                       that has since restarted at this address): refused, and the channel
                       notes its (authenticated) sender, whom the manager asks to bootstrap
    old_incarnation    `src` has already sent under a later (boot, sender id); accepted
                       again only after that one stayed silent for a whole replay window
                       (a peer host whose clock stepped back is locked out that long)

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
from kvrelay.core.keys import channel_password
from kvrelay.disagg.wire import MAX_FRAME_BYTES

MAGIC = b"KVA2"
_PREFIX = struct.Struct("!4sQQQ8sQ8s")
MAC_BYTES = 16
AUTH_BYTES = _PREFIX.size + 2 * MAC_BYTES
FIRST_CONTACT = (0, bytes(8))   # the receiver incarnation a sender names before it knows one
WINDOW = 1024          # counters behind the highest accepted one that may still arrive once
MAX_SENDERS = 4096     # replay state kept per sender address (least recently heard evicted)
BOOT_SLACK = 1.0       # s: how far before this receiver's start a first contact may be sealed
MAX_UNAWARE = 256      # senders refused as other_incarnation kept until the next take_unaware


class AuthError(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Stamp:
    """What a verified auth frame says about its sender, and whom it was sealed for."""
    boot: int
    sender: bytes
    counter: int
    rx: tuple[int, bytes] = FIRST_CONTACT


@dataclass
class _Seen:
    boot: int
    sender: bytes
    high: int          # highest counter accepted
    mask: int          # bit i: counter high - i was accepted
    heard: float       # wall time of the last accepted message

    def replayed(self, counter: int) -> bool:
        behind = self.high - counter
        return behind >= 0 and (behind >= WINDOW or bool((self.mask >> behind) & 1))


def _gate(key: bytes, prefix: bytes, dst: str, header_len: int, frames: Sequence) -> bytes:
    h = hmac.new(key, b"gate\0" + prefix, hashlib.sha256)
    h.update(dst.encode() + b"\0")
    h.update(struct.pack(f"!QI{len(frames)}Q", header_len, len(frames), *(memoryview(f).nbytes for f in frames)))
    return h.digest()[:MAC_BYTES]


def _header_mac(key: bytes, gate: bytes, header: bytes) -> bytes:
    h = hmac.new(key, b"header\0" + gate, hashlib.sha256)
    h.update(header)
    return h.digest()[:MAC_BYTES]


class ChannelAuth:
    """One channel's sealing state and its replay state per sender. `key` is the cluster
    key's control derivation; `wall` returns seconds since the epoch (injectable).
    Invariant: `_who` indexes `_seen` by (boot, sender id), entry for entry."""

    def __init__(self, key: bytes, replay_window: float = 60.0, *,
                 wall: Callable[[], float] = time.time) -> None:
        self._key = key
        self._wall = wall
        self.replay_window = replay_window
        self.boot = int(wall() * 1000)
        self.sender = bytes.fromhex(ids.token_hex(8))
        self._counter = 0
        self._seen: OrderedDict[str, _Seen] = OrderedDict()
        self._who: dict[tuple[int, bytes], _Seen] = {}
        self._unaware: set[str] = set()

    @property
    def password(self) -> str:
        """The zmq PLAIN password of channels keyed like this one (core.keys)."""
        return channel_password(self._key)

    @property
    def incarnation(self) -> tuple[int, bytes]:
        return self.boot, self.sender

    def take_unaware(self) -> set[str]:
        """Senders (authenticated) refused as other_incarnation since the last call: peers
        that have not yet learned that this receiver restarted."""
        out, self._unaware = self._unaware, set()
        return out

    def seal(self, dst: str, header: bytes, frames: Sequence = ()) -> bytes:
        """The auth frame to send to `dst` before `header` and `frames`."""
        self._counter += 1
        seen = self._seen.get(dst)
        rx = (seen.boot, seen.sender) if seen is not None else FIRST_CONTACT
        prefix = _PREFIX.pack(MAGIC, self.boot, self._counter, int(self._wall() * 1000), self.sender, *rx)
        gate = _gate(self._key, prefix, dst, len(header), frames)
        return prefix + gate + _header_mac(self._key, gate, header)

    def verify(self, dst: str, auth: bytes | None, header: bytes, frames: Sequence = ()) -> Stamp:
        """Check a message that arrived at `dst` (this channel's own address). Raises
        AuthError (no_auth | too_large | stale | before_boot | replay | bad_auth); the
        header is still unparsed, and hashed only once the gate mac matched."""
        stamp = self._precheck(auth, len(header))
        prefix, gate = auth[:_PREFIX.size], auth[_PREFIX.size:_PREFIX.size + MAC_BYTES]
        if not hmac.compare_digest(gate, _gate(self._key, prefix, dst, len(header), frames)):
            raise AuthError("bad_auth")
        if not hmac.compare_digest(auth[-MAC_BYTES:], _header_mac(self._key, gate, header)):
            raise AuthError("bad_auth")
        return stamp

    def _precheck(self, auth: bytes | None, header_len: int) -> Stamp:
        """Every check that costs the same whatever the frame's size: from the cleartext."""
        if auth is None or len(auth) != AUTH_BYTES or auth[:4] != MAGIC:
            raise AuthError("no_auth")
        if header_len > MAX_FRAME_BYTES:
            raise AuthError("too_large")
        _, boot, counter, sent_ms, sender, rx_boot, rx_sender = _PREFIX.unpack_from(auth)
        sent = sent_ms / 1000
        if abs(sent - self._wall()) > self.replay_window:
            raise AuthError("stale")
        rx = (rx_boot, rx_sender)
        if rx == FIRST_CONTACT and sent < self.boot / 1000 - BOOT_SLACK:
            raise AuthError("before_boot")
        seen = self._who.get((boot, sender))
        if seen is not None and seen.replayed(counter):
            raise AuthError("replay")
        return Stamp(boot, sender, counter, rx)

    def accept(self, src: str, stamp: Stamp) -> str | None:
        """Record a verified message from `src`; -> None, or the reason it is refused
        (other_incarnation, old_incarnation, replay). Call only after `verify` and after
        `src` was decoded from the authenticated header."""
        if stamp.rx not in (FIRST_CONTACT, self.incarnation):
            if len(self._unaware) < MAX_UNAWARE:
                self._unaware.add(src)
            return "other_incarnation"
        now = self._wall()
        seen = self._seen.get(src)
        who = (stamp.boot, stamp.sender)
        if seen is not None and who != (seen.boot, seen.sender):
            if who < (seen.boot, seen.sender) and now - seen.heard <= self.replay_window:
                return "old_incarnation"
            seen = None   # a new incarnation of src (or the old one outlived a silent window)
        if seen is None:
            self._remember(src, _Seen(stamp.boot, stamp.sender, stamp.counter, 1, now))
            return None
        if seen.replayed(stamp.counter):
            return "replay"
        if stamp.counter > seen.high:
            seen.mask = ((seen.mask << (stamp.counter - seen.high)) | 1) & ((1 << WINDOW) - 1)
            seen.high = stamp.counter
        else:
            seen.mask |= 1 << (seen.high - stamp.counter)
        seen.heard = now
        self._seen.move_to_end(src)
        return None

    def _remember(self, src: str, seen: _Seen) -> None:
        self._forget(src)
        self._seen[src] = seen
        self._who[(seen.boot, seen.sender)] = seen
        while len(self._seen) > MAX_SENDERS:
            self._forget(next(iter(self._seen)))

    def _forget(self, src: str) -> None:
        old = self._seen.pop(src, None)
        if old is not None and self._who.get((old.boot, old.sender)) is old:
            del self._who[(old.boot, old.sender)]

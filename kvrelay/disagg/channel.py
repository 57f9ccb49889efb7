"""The control channel between workers: addressed, unreliable, never blocking.

Contract (every implementation):
- `send(dst, msg, frames)` never blocks. It returns False when the message was dropped
  (peer unknown, queue full); the lifecycle treats loss like any other fault (resends,
  leases, deadlines), so no caller ever waits on a send.
- `recv()` never blocks; it returns whatever has arrived, each with its sender's address.
- Messages between one pair of channels arrive in send order, at most once (a
  FaultyChannel in front may break both on purpose).
- Extra `frames` are raw bytes (bulk KV data); they pass through untouched.
- `recv()` returns only frames that `wire.decode` accepted. A rejected one is dropped,
  counted in kvrelay_rejected_input_total{surface="control",reason=<WireError.reason>}
  and logged at debug on `kvrelay.input` ("rejected input", with surface, reason, detail,
  src); it never raises into the caller's loop.
- With `auth` set (a cluster key), every message is sealed as [auth, header, *data] and
  `recv()` returns only messages that `auth` verifies (disagg.auth: mac, freshness,
  replay, incarnation), before their header is parsed; the rest are dropped and counted
  like any rejected frame. Set `auth` before the first send or recv (a ZmqChannel takes
  it at construction: its sockets' handshake depends on it).
- A send never creates a socket to something that is not a valid tcp endpoint, the
  sockets a channel keeps are capped (least recently used closed first), and a connect
  that fails drops that one message (send returns False), nothing else.

What a zmq channel lets in, before anything reaches the loop that calls `recv()`:
- Keyed: its socket speaks zmq's PLAIN mechanism, and the process's ZAP handler (one per
  process, running while a keyed channel is open) admits only user PLAIN_USER with the
  key's channel password (core.keys). A peer without the key fails the handshake
  (refusals of a presented password counted as "bad_handshake"), so not one of its bytes
  is buffered as a message; a connection still in its handshake after HANDSHAKE_MS is
  dropped. The password crosses the wire in clear at each handshake: it opens the
  socket, never a frame (every frame still needs its auth frame).
- Every frame is at most `max_msg_size`: zmq drops a connection announcing a bigger one
  before buffering it.
- One `recv()` call pulls at most RECV_FRAMES frames and RECV_BYTES bytes, accepted or
  rejected alike (plus at most MAX_PARTS frames of the message it is in), so its cost is
  bounded whatever arrives; the rest waits for the next call. zmq's PULL fair-queues
  between connections (one complete message from each in turn): that is the per-peer
  limit on the read side, so a busy peer cannot starve another. A message of more than
  MAX_PARTS frames is dropped whole ("too_many_frames"), its rest skipped within budget.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvrelay.disagg import wire
from kvrelay.disagg.auth import AUTH_BYTES, MAGIC, AuthError, ChannelAuth
from kvrelay.obs.metrics import reject_input

log = logging.getLogger("kvrelay.channel")

Frame = bytes | bytearray | memoryview

# Frames at least this big go to zmq without a copy.
ZERO_COPY_MIN = 64 * 1024
# PUSH sockets one channel keeps open (one per peer it sends to); zmq's own limit is 1023
# sockets per context, and peers above this are reconnected on their next send.
MAX_SOCKETS = 256
# Per recv() call: frames (and their bytes) pulled off the socket, accepted or rejected.
RECV_FRAMES = 4096
RECV_BYTES = 256 << 20
MAX_PARTS = 16            # frames of one message: auth, header and data frames
HANDSHAKE_MS = 5000       # a connection that has not completed zmq's handshake by then is dropped
PLAIN_USER = "kvrelay"


@dataclass(frozen=True)
class Received:
    src: str               # the sender's control address: where replies go
    msg: wire.Message
    frames: tuple = ()     # raw data frames (memoryview-compatible), empty for control


class Channel(ABC):
    """One worker's control endpoint. `address` is what peers send to."""
    address: str
    auth: ChannelAuth | None = None
    _warned_unkeyed = False

    def _parts(self, dst: str, msg: wire.Message, frames: Sequence[Frame]) -> list:
        """What goes on the wire for one message to `dst` (see the module docstring)."""
        header = wire.encode(msg, self.address)
        if self.auth is None:
            return [header, *frames]
        return [self.auth.seal(dst, header, frames), header, *frames]

    def _open(self, parts: list, schemes: tuple[str, ...] | None) -> Received | None:
        """The message `parts` (as they arrived) carry, or None: dropped and counted."""
        auth = self.auth
        try:
            if auth is not None:
                if len(parts) < 2:
                    raise AuthError("no_auth")
                stamp = auth.verify(self.address, bytes(parts[0]), bytes(parts[1]), parts[2:])
                header, data = parts[1], parts[2:]
            else:
                header, data = parts[0], parts[1:]
                if len(header) == AUTH_BYTES and bytes(header[:4]) == MAGIC:
                    self._warn_unkeyed()
                    raise AuthError("auth_not_configured")
            src, msg = wire.decode(header, schemes=schemes)
            if auth is not None:
                reason = auth.accept(src, stamp)
                if reason:
                    reject_input("control", reason, msg.KIND, src)
                    return None
        except AuthError as e:
            reject_input("control", e.reason)
            return None
        except wire.WireError as e:  # a foreign or corrupt frame never stops the loop
            reject_input("control", e.reason, e.detail)
            return None
        return Received(src, msg, tuple(data))

    def blob(self, dst: str, msg: wire.Message) -> bytes:
        """One message (no data frames) as a single byte string, sealed like `send`
        would: for paths other than this channel (a backend's notifications)."""
        return b"".join(self._parts(dst, msg, ()))

    def open_blob(self, raw: bytes) -> Received | None:
        """The inverse of `blob`: the message, or None (dropped and counted)."""
        raw = bytes(raw)
        parts = [raw[:AUTH_BYTES], raw[AUTH_BYTES:]] if self.auth is not None else [raw]
        return self._open(parts, None)

    def _warn_unkeyed(self) -> None:
        if not self._warned_unkeyed:
            self._warned_unkeyed = True
            log.warning("dropping signed control messages: this worker has no cluster key but a peer has one "
                        "(give every process of the cluster the same --cluster-key-file)")

    @abstractmethod
    def send(self, dst: str, msg: wire.Message, frames: Sequence[Frame] = ()) -> bool: ...

    @abstractmethod
    def recv(self, max_n: int = 10_000) -> list[Received]: ...

    def forget(self, dst: str) -> None:
        """Drop any per-peer state (e.g. a socket to a dead peer)."""

    @abstractmethod
    def close(self) -> None: ...


# ---- in-process (the `fake` backend and unit tests) ---------------------------------

class InProcNetwork:
    """A set of in-process channels that can reach each other by address. A queue holds
    each message as the list of byte strings a zmq channel would send."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[list[bytes]]] = {}
        self._next = 0

    def channel(self, name: str | None = None) -> "InProcChannel":
        if name is None:
            self._next += 1
            name = f"inproc://w{self._next}"
        return InProcChannel(self, name)


class InProcChannel(Channel):
    """Every message goes through wire.encode/decode, so the fake backend exercises the
    same serialization the real ones do."""

    def __init__(self, network: InProcNetwork, address: str) -> None:
        if address in network.queues:
            raise ValueError(f"address {address} already bound")
        self.network = network
        self.address = address
        network.queues[address] = deque()

    def send(self, dst: str, msg: wire.Message, frames: Sequence[Frame] = ()) -> bool:
        q = self.network.queues.get(dst)
        if q is None:
            return False
        q.append([bytes(p) for p in self._parts(dst, msg, frames)])
        return True

    def recv(self, max_n: int = 10_000) -> list[Received]:
        q = self.network.queues.get(self.address)
        out: list[Received] = []
        while q and len(out) < max_n:
            got = self._open(q.popleft(), None)
            if got is not None:
                out.append(got)
        return out

    def close(self) -> None:
        self.network.queues.pop(self.address, None)


# ---- zmq (every real backend) -------------------------------------------------------

# zmq.EVENTS, zmq.POLLIN, zmq.RCVMORE as plain ints: the enum ops cost microseconds.
_EVENTS, _POLLIN, _RCVMORE = 15, 1, 13


class _KeyedZap(ThreadAuthenticator):
    """A ZAP handler that admits PLAIN user PLAIN_USER with its domain's password
    (compared in constant time, never logged) and counts every refusal."""

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        want = self.passwords.get(domain, {}).get(username)
        if want is not None and hmac.compare_digest(want.encode(), password.encode()):
            return True, b"OK"
        reject_input("control", "bad_handshake")
        return False, b"no access"


class _Zap:
    """The process's one ZAP handler (zmq has one per context, at a fixed inproc address):
    started by the first keyed channel, stopped with the last. One domain per password
    (per cluster key in use), configured while a channel uses it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handler: _KeyedZap | None = None
        self._users: dict[str, int] = {}

    def acquire(self, ctx, password: str) -> str:
        """-> the ZAP domain a server socket keyed with `password` names."""
        domain = "kvrelay-" + hashlib.sha256(password.encode()).hexdigest()[:16]
        with self._lock:
            if self._handler is None:
                self._handler = self._start(ctx)
            if domain not in self._users:
                self._handler.configure_plain(domain, {PLAIN_USER: password})
            self._users[domain] = self._users.get(domain, 0) + 1
        return domain

    def release(self, domain: str) -> None:
        with self._lock:
            self._users[domain] -= 1
            if self._users[domain]:
                return
            del self._users[domain]
            assert self._handler is not None
            self._handler.passwords.pop(domain, None)
            if not self._users:
                self._handler.stop()
                self._handler = None

    @staticmethod
    def _start(ctx, attempts: int = 200) -> _KeyedZap:
        """A handler just stopped may hold its inproc address a moment longer: retry."""
        for _ in range(attempts - 1):
            handler = _KeyedZap(ctx, log=log)
            try:
                handler.start()
                return handler
            except zmq.ZMQError as e:
                handler.stop()
                if e.errno != zmq.EADDRINUSE:
                    raise
                time.sleep(0.01)
        handler = _KeyedZap(ctx, log=log)
        handler.start()
        return handler


_ZAP = _Zap()


class _Budget:
    """What one recv() call may still pull off the socket."""

    def __init__(self) -> None:
        self.frames, self.nbytes = RECV_FRAMES, RECV_BYTES

    def spend(self, frame) -> None:
        self.frames -= 1
        self.nbytes -= len(frame)

    def __bool__(self) -> bool:
        return self.frames > 0 and self.nbytes > 0


class ZmqChannel(Channel):
    """One PULL socket bound at tcp://host:port; one PUSH socket per peer, connected on
    first send (at most `max_sockets`, least recently used closed first). All sends are
    NOBLOCK with linger 0: a full or dead peer drops messages rather than stalling the
    scheduler loop. `max_msg_size` (bytes, per frame) makes zmq drop a connection that
    announces a bigger frame as soon as its length arrives, before buffering it. `auth`
    (a cluster key) seals every message and makes every socket speak PLAIN (module
    docstring); it is fixed for the channel's life."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, hwm: int = 10_000,
                 max_msg_size: int | None = None, max_sockets: int = MAX_SOCKETS,
                 auth: ChannelAuth | None = None) -> None:
        self._ctx = zmq.Context.instance()
        self._hwm = hwm
        self._max_sockets = max_sockets
        self._auth = auth
        self._skipping = False   # mid-way through a message of more than MAX_PARTS frames
        self._zap = _ZAP.acquire(self._ctx, auth.password) if auth is not None else None
        self._push: OrderedDict[str, object] = OrderedDict()  # least recently used first
        self._pull = self._ctx.socket(zmq.PULL)
        try:
            self._listen(host, port, hwm, max_msg_size)
        except BaseException:
            self.close()
            raise

    @property
    def auth(self) -> ChannelAuth | None:  # type: ignore[override]
        return self._auth

    @auth.setter
    def auth(self, value: ChannelAuth | None) -> None:
        if value is not self._auth:
            raise AttributeError("a ZmqChannel's auth is fixed at construction: ZmqChannel(auth=...)")

    def _listen(self, host: str, port: int, hwm: int, max_msg_size: int | None) -> None:
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, hwm)
        if max_msg_size is not None:
            self._pull.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
        self._secure(self._pull, server=True)
        if port == 0:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        else:
            self._bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"

    def _secure(self, sock, server: bool) -> None:
        """Set before bind or connect: PLAIN with the channel password when keyed (the
        server side asks the ZAP handler, and refuses all if none runs), NULL otherwise."""
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        if self._auth is None:
            return
        if server:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, self._zap.encode())
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER.encode())
            sock.setsockopt(zmq.PLAIN_PASSWORD, self._auth.password.encode())

    def _bind(self, endpoint: str, attempts: int = 200) -> None:
        """zmq closes sockets in its I/O thread, so a port closed a moment ago (a restart at
        the same address) may still be busy: retry briefly at startup, never in the loop."""
        for i in range(attempts):
            try:
                self._pull.bind(endpoint)
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or i == attempts - 1:
                    raise
                time.sleep(0.01)

    def _socket(self, dst: str):
        """The PUSH socket to `dst`, or None when `dst` is not a tcp endpoint or cannot be
        connected (that message is lost; the lifecycle treats it like any loss)."""
        sock = self._push.get(dst)
        if sock is not None:
            self._push.move_to_end(dst)
            return sock
        if not wire.valid_endpoint(dst, ("tcp",)):
            log.warning("not sending to %r: not a tcp://host:port address", dst[:100])
            return None
        while len(self._push) >= self._max_sockets:
            self.forget(next(iter(self._push)))
        try:
            sock = self._ctx.socket(zmq.PUSH)
        except zmq.ZMQError as e:  # e.g. too many open files: this send fails, not the loop
            log.warning("cannot open a socket to %s: %s", dst, e)
            return None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._hwm)
            sock.setsockopt(zmq.RECONNECT_IVL, 10)  # ms: a restarted peer is reached fast
            self._secure(sock, server=False)
            sock.connect(dst)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            log.warning("cannot connect to %s: %s", dst, e)
            return None
        self._push[dst] = sock
        return sock

    def send(self, dst: str, msg: wire.Message, frames: Sequence[Frame] = ()) -> bool:
        sock = self._socket(dst)
        if sock is None:
            return False
        parts = self._parts(dst, msg, frames)
        big = any(len(memoryview(f)) >= ZERO_COPY_MIN for f in frames)
        try:
            sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=not big)
            return True
        except zmq.Again:
            return False

    def sockets(self) -> list[str]:
        """Addresses this channel holds a PUSH socket to (introspection, tests)."""
        return list(self._push)

    def recv(self, max_n: int = 10_000) -> list[Received]:
        out: list[Received] = []
        budget = _Budget()
        # Asking EVENTS first lets libzmq process pending commands unthrottled, which a
        # NOBLOCK recv on an idle socket does only about once a millisecond.
        while budget and len(out) < max_n and self._pull.getsockopt(_EVENTS) & _POLLIN:
            if self._skipping:
                self._skip(budget)
                continue
            parts = self._message(budget)
            if parts is None:
                break
            got = self._open(parts, ("tcp",)) if parts else None
            if got is not None:
                out.append(got)
        return out

    def _message(self, budget: _Budget) -> list | None:
        """The next message's frames (every one charged to `budget`); [] when it has more
        than MAX_PARTS (dropped, counted, and its rest skipped); None when none is left."""
        pull = self._pull
        try:
            parts = [pull.recv(flags=zmq.NOBLOCK)]  # small: a copy is cheaper than a Frame
        except zmq.Again:
            return None
        if self._auth is not None and pull.getsockopt(_RCVMORE):
            parts.append(pull.recv())  # the header after the auth frame: small too
        while pull.getsockopt(_RCVMORE) and len(parts) < MAX_PARTS:  # bulk data: zero-copy
            parts.append(pull.recv(copy=False).buffer)
        for part in parts:
            budget.spend(part)
        if pull.getsockopt(_RCVMORE):
            self._skipping = True
            reject_input("control", "too_many_frames", f"more than {MAX_PARTS}")
            return []
        return parts

    def _skip(self, budget: _Budget) -> None:
        """Drop the rest of a message of more than MAX_PARTS frames, within `budget`."""
        while budget and self._pull.getsockopt(_RCVMORE):
            budget.spend(self._pull.recv(copy=False).buffer)
        self._skipping = bool(self._pull.getsockopt(_RCVMORE))

    def forget(self, dst: str) -> None:
        sock = self._push.pop(dst, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for dst in list(self._push):
            self.forget(dst)
        self._pull.close(linger=0)
        if self._zap is not None:
            _ZAP.release(self._zap)
            self._zap = None

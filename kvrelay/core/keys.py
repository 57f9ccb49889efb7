"""The cluster key: one shared secret per cluster, and every credential derived from it.

Every process of one cluster (router, prefill and decode workers) holds the same secret,
read from `--cluster-key-file` or the environment variable KVRELAY_CLUSTER_KEY (the file
wins). `kvrelay serve` makes a random one for the workers it starts. The secret itself
never crosses the network; what does is derived from it with HMAC-SHA256 under a fixed
label per use, so one credential never reveals another or the secret:

    control      the key of the HMAC on every control and data-header frame (disagg.auth)
    channel      the password of the channel's zmq PLAIN handshake (disagg.channel), derived
                 from the control key (what a channel holds) under this label; it travels
                 in clear at every handshake, so it opens the socket and nothing else
    worker-http  the bearer token the router presents to workers' HTTP APIs

Invariants: a secret is at least MIN_BYTES bytes; derived values depend only on the
secret and the label (every process computes the same ones); comparisons of presented
credentials are constant-time (`hmac.compare_digest`).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

ENV = "KVRELAY_CLUSTER_KEY"
MIN_BYTES = 16
GENERATED_BYTES = 32


def channel_password(control_key: bytes) -> str:
    """The zmq PLAIN password of every channel keyed with `control_key` (hex: zmq
    passwords are text)."""
    return hmac.new(control_key, b"kvrelay/channel", hashlib.sha256).hexdigest()


class ClusterKey:
    """A cluster's shared secret. `str()` never shows it."""

    def __init__(self, secret: bytes, source: str = "") -> None:
        if len(secret) < MIN_BYTES:
            raise ValueError(f"the cluster key{' in ' + source if source else ''} is {len(secret)} bytes; "
                             f"it needs at least {MIN_BYTES} (make one with `kvrelay keygen`)")
        self._secret = bytes(secret)
        self.source = source

    @classmethod
    def generate(cls) -> "ClusterKey":
        return cls(secrets.token_hex(GENERATED_BYTES).encode(), "generated")

    @classmethod
    def load(cls, path: str | None, environ: dict[str, str] | None = None) -> "ClusterKey | None":
        """The key from `path` (surrounding whitespace stripped) or else from
        KVRELAY_CLUSTER_KEY; None when neither is set. Raises ValueError with one line
        saying what to fix (unreadable file, empty or short key)."""
        if path:
            try:
                with open(path, "rb") as f:
                    mode = os.fstat(f.fileno()).st_mode
                    secret = f.read(1 << 16).strip()
            except OSError as e:
                raise ValueError(f"cannot read --cluster-key-file {path}: {e.strerror}") from None
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                import logging
                logging.getLogger("kvrelay.security").warning(
                    "cluster key file %s is readable by group or others (chmod 600 it)", path)
            return cls(secret, path)
        value = (os.environ if environ is None else environ).get(ENV, "").strip()
        return cls(value.encode(), ENV) if value else None

    def export(self) -> str:
        """The secret as the value of KVRELAY_CLUSTER_KEY for a child process."""
        return self._secret.decode("latin-1")

    def derive(self, label: str) -> bytes:
        return hmac.new(self._secret, b"kvrelay/" + label.encode(), hashlib.sha256).digest()

    @property
    def control_key(self) -> bytes:
        return self.derive("control")

    @property
    def channel_password(self) -> str:
        return channel_password(self.control_key)

    @property
    def http_token(self) -> str:
        """What the router sends as `Authorization: Bearer ...` to workers."""
        return self.derive("worker-http").hex()

    def check_http_token(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self.http_token.encode())

    def __repr__(self) -> str:
        return f"ClusterKey(source={self.source!r})"

"""Who may call kvrelay over HTTP, and where a worker may listen (issue #10).

The rules (flags in docs/operations.md "Authentication"; threat model in docs/security.md):

1. A worker without a cluster key (--cluster-key-file, or KVRELAY_CLUSTER_KEY) listens on
   loopback only, --host and --transfer-host both: nothing it serves is authenticated, so
   only this host may reach it. --enable-fault-injection beyond loopback needs a key too.
2. A worker with a cluster key answers every route but /health and /metrics only to
   `Authorization: Bearer <ClusterKey.http_token>`, which the router sends on every call.
3. The front door (`kvrelay router`, `serve`, `serve --mode colocated`) with API keys
   (--api-key; else KVRELAY_API_KEY, comma-separated) answers every route but /health and
   /metrics, unknown paths included, only to `Authorization: Bearer <one of the keys>`.
   Without a key it is open, as before.
4. --protect-metrics puts /health and /metrics behind the same credential (so it needs one).
5. --max-streams-per-key N: at most N requests in flight per API key, from the request's
   start until its response has ended or its client has left; beyond it 429 with
   Retry-After. A POST counts one on arrival and, once its body is parsed, as many as it
   asks for (`charge`: prompts x n choices), so a batch is never a way around the cap.
   Without API keys, every client shares one bucket.
6. A refusal is an OpenAI error body: 401 with `WWW-Authenticate: Bearer`, or 429. The
   check runs before routing and before the body is read. A presented credential is
   compared in constant time with every accepted one (`hmac.compare_digest` on SHA-256
   digests, so not even its length shows).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass, field

from kvrelay.core.config import KVRelayConfig, SecurityConfig
from kvrelay.core.keys import ClusterKey
from kvrelay.server.errors import RETRY_AFTER_S, OpenAIError, StartupError, error_response

log = logging.getLogger("kvrelay.security")

API_KEY_ENV = "KVRELAY_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})
# Set on every HTTP scope by `Guard`: "off" (the app takes no credential), "ok" (the
# caller's is right) or "refused" (missing or wrong). A worker reports it in /health, so
# the router can tell that the workers expect another key than its own.
AUTH_SCOPE = "kvrelay.auth"
METER_SCOPE = "kvrelay.meter"   # the request's `Meter`, when its key has a --max-streams-per-key cap
ANONYMOUS = -1   # the shared --max-streams-per-key bucket when no keys are configured
KEYGEN_HINT = "set --cluster-key-file or KVRELAY_CLUSTER_KEY (make a key with `kvrelay keygen`)"


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


@dataclass(frozen=True)
class Gate:
    """What one HTTP app asks of its callers."""
    tokens: tuple[str, ...] = ()          # accepted bearer tokens; none: anyone may call
    open_paths: frozenset[str] = OPEN_PATHS   # served without a token
    max_streams: int = 0                  # POST requests in flight per token (0: no cap)
    code: str = "invalid_api_key"         # the 401's error code
    what: str = "API key"                 # the credential, as the 401 names it
    _digests: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_digests", tuple(_digest(t) for t in self.tokens))

    @property
    def active(self) -> bool:
        return bool(self.tokens or self.max_streams)

    def match(self, presented: bytes | None) -> int | None:
        """The index of the accepted token `presented` is, or None. Every token is compared,
        each in constant time."""
        if presented is None:
            return None
        got, hit = _digest(presented), None
        for i, want in enumerate(self._digests):
            if hmac.compare_digest(got, want) and hit is None:
                hit = i
        return hit


def bearer(scope) -> bytes | None:
    """The token of the request's first `Authorization: Bearer ...` header."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return (token.strip() or None) if scheme.lower() == b"bearer" else None
    return None


class Guard:
    """ASGI middleware that enforces a `Gate` on every HTTP request before the app (its
    routing, its body limit) sees it, so an unauthenticated caller learns nothing about
    which paths exist. In-flight counts live here: one event loop, so checking and taking a
    slot happen with no await in between."""

    def __init__(self, app, gate: Gate) -> None:
        self.app, self.gate = app, gate
        self.in_flight: dict[int, int] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gate = self.gate
        who = gate.match(bearer(scope)) if gate.tokens else ANONYMOUS
        scope[AUTH_SCOPE] = "off" if not gate.tokens else "refused" if who is None else "ok"
        if scope["path"] in gate.open_paths:
            await self.app(scope, receive, send)
        elif who is None:
            await self._refuse(self._unauthorized(scope), scope, receive, send)
        elif gate.max_streams and scope["method"] == "POST":
            await self._metered(who, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _metered(self, who: int, scope, receive, send) -> None:
        meter = Meter(self, who)
        try:
            meter.take(1)
        except OpenAIError as err:
            await self._refuse(err, scope, receive, send)
            return
        scope[METER_SCOPE] = meter
        try:
            await self.app(scope, receive, send)
        finally:   # the response has ended, or the client left (the app returned or raised)
            meter.release()

    def too_many(self, who: int, held: int, asked: int, param: str | None = None) -> OpenAIError:
        whose = "all clients together (no API key is set)" if who == ANONYMOUS else f"this {self.gate.what}"
        cap = self.gate.max_streams
        if asked > cap:
            return OpenAIError(400, f"this request asks for {asked} completions (prompts x n), more than "
                               f"--max-streams-per-key {cap} allows {whose} at once", param, "too_many_completions")
        message = (f"{held} requests of {whose} are in flight (--max-streams-per-key {cap}); this one "
                   f"asks for {asked}; retry when enough have finished")
        return OpenAIError(429, message, None, "rate_limit_exceeded", {"Retry-After": str(RETRY_AFTER_S)})

    def _unauthorized(self, scope) -> OpenAIError:
        what = self.gate.what
        message = (f"Incorrect {what} provided." if bearer(scope) is not None else
                   f"No {what} provided: send it in an Authorization header using Bearer auth "
                   f"(Authorization: Bearer YOUR_KEY).")
        return OpenAIError(401, message, None, self.gate.code, {"WWW-Authenticate": "Bearer"})

    @staticmethod
    async def _refuse(err: OpenAIError, scope, receive, send) -> None:
        log.debug("request refused", extra={"status": err.status, "path": scope["path"]})
        await error_response(err)(scope, receive, send)


class Meter:
    """One request's share of its key's --max-streams-per-key bucket. One event loop:
    checking and taking happen with no await in between."""

    def __init__(self, guard: Guard, who: int) -> None:
        self.guard, self.who, self.held = guard, who, 0

    def take(self, units: int, param: str | None = None) -> None:
        """Hold `units` more, or raise the 429 (a 400 naming `param` if they can never fit)
        and hold nothing more."""
        flights = self.guard.in_flight
        held = flights.get(self.who, 0)
        if held + units > self.guard.gate.max_streams:
            raise self.guard.too_many(self.who, held - self.held, self.held + units, param)
        flights[self.who] = held + units
        self.held += units

    def release(self) -> None:
        flights = self.guard.in_flight
        flights[self.who] -= self.held
        self.held = 0
        if not flights[self.who]:
            del flights[self.who]


def charge(scope, units: int, param: str) -> None:
    """The request of `scope` asks for `units` completions (prompts x n): its key's bucket
    holds that many while it runs. Raises the 429 (or a 400 naming `param`) when they do
    not fit."""
    meter = scope.get(METER_SCOPE)
    if meter is not None and units > meter.held:
        meter.take(units - meter.held, param)


def guard(app, gate: Gate | None) -> None:
    """Put `gate` in front of `app` (outermost, so it runs before the body limit)."""
    if gate is not None and gate.active:
        app.add_middleware(Guard, gate=gate)


# ---------------------------------------------------------------- the gates of each app

def api_keys(sec: SecurityConfig, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """--api-key values, or else those of KVRELAY_API_KEY (comma-separated). Raises StartupError."""
    if sec.api_key:
        return sec.api_key
    raw = (os.environ if environ is None else environ).get(API_KEY_ENV, "")
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if raw.strip() and not keys:
        raise StartupError(f"{API_KEY_ENV} holds no key (it takes a comma-separated list)")
    return keys


def api_gate(sec: SecurityConfig, environ: dict[str, str] | None = None) -> Gate:
    """The front door's gate (router, serve, colocated). Raises StartupError."""
    keys = api_keys(sec, environ)
    if sec.protect_metrics and not keys:
        raise StartupError(f"--protect-metrics needs an API key (--api-key or {API_KEY_ENV})")
    return Gate(keys, frozenset() if sec.protect_metrics else OPEN_PATHS, sec.max_streams_per_key)


def worker_gate(key: ClusterKey | None, sec: SecurityConfig) -> Gate:
    """A worker's gate: the router's token when the cluster has a key."""
    tokens = (key.http_token,) if key is not None else ()
    return Gate(tokens, frozenset() if sec.protect_metrics else OPEN_PATHS, code="invalid_token",
                what="cluster token")


def auth_headers(key: ClusterKey | None) -> dict[str, str]:
    """The headers every router -> worker request carries."""
    return {"Authorization": f"Bearer {key.http_token}"} if key is not None else {}


def load_cluster_key(sec: SecurityConfig) -> ClusterKey | None:
    """The key of --cluster-key-file or KVRELAY_CLUSTER_KEY, or None. Raises StartupError."""
    try:
        return ClusterKey.load(sec.cluster_key_file)
    except ValueError as exc:
        raise StartupError(str(exc)) from None


# ---------------------------------------------------------------- workers: where they may listen

def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_worker(config: KVRelayConfig, role: str, key: ClusterKey | None) -> None:
    """Rules 1 and 4 for a worker, before anything starts. Raises StartupError."""
    transfer, srv = config.transfer, config.server
    asked = transfer.fault_spec or os.environ.get("KVRELAY_FAULTS")
    if asked and not transfer.enable_fault_injection:
        raise StartupError("a fault spec (--fault-spec or KVRELAY_FAULTS) needs --enable-fault-injection")
    outside = [f"{flag} {host}" for flag, host in (("--host", srv.host), ("--transfer-host", transfer.transfer_host))
               if not loopback(host)]
    if key is None and outside and transfer.enable_fault_injection:
        raise StartupError("--enable-fault-injection needs --host and --transfer-host on loopback (127.0.0.1) "
                           f"unless the cluster has a key: anyone who reaches the port could switch faults on; "
                           f"{KEYGEN_HINT}")
    if key is None and outside:
        raise StartupError(f"the {role} worker refuses to listen beyond loopback ({', '.join(outside)}) without a "
                           f"cluster key, since anyone who reached it could drive it: {KEYGEN_HINT}")
    if key is None and config.security.protect_metrics:
        raise StartupError(f"--protect-metrics on a worker needs a cluster key: {KEYGEN_HINT}")


# ---------------------------------------------------------------- TLS

def check_tls(sec: SecurityConfig) -> None:
    """Load --ssl-certfile/--ssl-keyfile and --ssl-ca-certs once now, so a bad file ends
    start-up with one line rather than a traceback from uvicorn or the first request."""
    try:
        if sec.ssl_certfile:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(sec.ssl_certfile, sec.ssl_keyfile)
        if sec.ssl_ca_certs:
            ssl.create_default_context(cafile=sec.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"cannot load the TLS files: {exc}") from None


def worker_verify(sec: SecurityConfig) -> ssl.SSLContext | bool:
    """How the router checks https:// workers: against --ssl-ca-certs when given, else the
    system's trusted CAs."""
    return ssl.create_default_context(cafile=sec.ssl_ca_certs) if sec.ssl_ca_certs else True

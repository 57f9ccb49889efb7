"""Start-up helpers shared by every serving command: the listening port, progress bar,
startup line, uvicorn.

Ports. Every serving command claims its --host/--port first thing (`claim_port`, called by
the CLI before any model, tokenizer or worker loads), so a port in use ends start-up in
well under a second with one line. The claimed socket is bound but not yet listening:
connections are refused while the model loads. It starts listening when `serving_url`
composes the "serving on" line, so that line is true when it is printed, and uvicorn is
handed that same socket (`uvicorn_options`), never a second bind of the port.

Connections. uvicorn serves through `connections.BoundedHttp`, which bounds and times every
connection (--header-timeout, --body-timeout, --max-connections,
--max-connections-per-client, --limit-concurrency); the process's open-file limit is
raised to its hard limit first, and --max-connections kept below it with a reserve.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import resource
import signal
import socket
import sys

import uvicorn
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvrelay.core.config import KVRelayConfig, SecurityConfig, ServerConfig
from kvrelay.obs.logs import AccessLog
from kvrelay.server.connections import bounded_protocol
from kvrelay.server.errors import StartupError

BACKLOG = 2048  # uvicorn's default
# The sockets claimed by this process, by (--host, --port) as configured (port 0 included).
_claimed: dict[tuple[str, int], socket.socket] = {}


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not listening. Raises OSError."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn does: TIME_WAIT is no conflict
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def _port_error(what: str, host: str, port: int, exc: OSError) -> StartupError:
    where = f"{host}:{port} ({what})"
    if exc.errno == errno.EADDRINUSE:
        return StartupError(f"{where} is already in use: stop the process that holds it "
                            f"(`ss -ltnp 'sport = :{port}'` names it) or choose another port")
    if exc.errno == errno.EACCES:
        return StartupError(f"{where}: permission denied (ports below 1024 need root)")
    return StartupError(f"{where} cannot be bound: {exc.strerror or exc}")


def claim_port(srv: ServerConfig, what: str = "--port") -> None:
    """Bind --host/--port now, before anything slow starts. Raises StartupError with one
    line when the port is taken or the address is not this host's."""
    key = (srv.host, srv.port)
    if key in _claimed:
        return
    try:
        _claimed[key] = _bound_socket(srv.host, srv.port)
    except (OSError, UnicodeError) as exc:   # socket.gaierror is an OSError
        if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EACCES):
            raise _port_error(what, srv.host, srv.port, exc) from None
        raise StartupError(f"cannot listen on {srv.host}:{srv.port} ({what}): {exc}") from None


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise StartupError unless (host, port) could be bound now (for a port a child
    process binds itself)."""
    try:
        _bound_socket(host, port).close()
    except OSError as exc:
        raise _port_error(what, host, port, exc) from None


def release_ports() -> None:
    """Close every claimed socket: after the server stopped, the port refuses at once
    instead of holding connections nobody will accept."""
    while _claimed:
        _claimed.popitem()[1].close()


def _listening(srv: ServerConfig) -> socket.socket | None:
    """The claimed socket of `srv`, now listening; None when none was claimed (tests that
    run uvicorn on their own). Raises StartupError if another process, which bound the port
    while we loaded, listens there first."""
    sock = _claimed.get((srv.host, srv.port))
    if sock is not None:
        try:
            sock.listen(BACKLOG)
        except OSError as exc:
            raise _port_error("--port", srv.host, srv.port, exc) from None
    return sock


# ---------------------------------------------------------------- `kvrelay serve`'s workers

WORKER_HOST = "127.0.0.1"   # the workers `kvrelay serve` starts listen on loopback only


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((WORKER_HOST, 0))
        return s.getsockname()[1]


def worker_ports(config: KVRelayConfig) -> list[int]:
    """The HTTP port of each local worker, prefill workers first, then decode: consecutive
    from --worker-base-port (default --port + 1). Base 0 (or --port 0 with no base): a
    free port each, chosen now. Raises StartupError for a range past 65535 or one that
    holds the router's own --port."""
    cl, port = config.cluster, config.server.port
    count = cl.num_prefill + cl.num_decode
    base = cl.worker_base_port if cl.worker_base_port is not None else (port + 1 if port else 0)
    if base == 0:
        return [_free_port() for _ in range(count)]
    ports = list(range(base, base + count))
    if ports[-1] > 65535:
        raise StartupError(f"the workers' ports {base}-{ports[-1]} run past 65535: choose a lower "
                           "--worker-base-port (or --port)")
    if port in ports:
        raise StartupError(f"--port {port} is also a worker's port ({base}-{ports[-1]}, from --worker-base-port): "
                           "choose ports that do not overlap")
    return ports


def check_worker_ports(config: KVRelayConfig, ports: list[int]) -> None:
    """Every local worker's HTTP port, and its fixed --transfer-port if any, is free now.
    Raises StartupError naming the first that is not."""
    names = worker_names(config)
    transfer = config.transfer
    for ordinal, (name, port) in enumerate(zip(names, ports)):
        check_port_free(WORKER_HOST, port, f"the {name}'s port: --worker-base-port + {ordinal}")
        if transfer.transfer_port:
            check_port_free(transfer.transfer_host, transfer.transfer_port + ordinal,
                            f"the {name}'s transfer port: --transfer-port + {ordinal}")


def worker_names(config: KVRelayConfig) -> list[str]:
    cl = config.cluster
    return [f"prefill worker {i}" for i in range(cl.num_prefill)] + [f"decode worker {j}" for j in range(cl.num_decode)]


# ---------------------------------------------------------------- loading and serving

def load_with_progress(load_model, opts):
    """Load the model with a progress bar on stderr when it is a terminal (a log file or a
    pipe gets no bar); a load error exits with one line. The process's heap thresholds
    are pinned first (`engine.heap`): an engine reuses its steps' temporaries."""
    from kvrelay.engine.heap import pin_heap_thresholds
    from kvrelay.engine.loader import ModelLoadError

    logging.getLogger("kvrelay.startup").debug("heap: %s", pin_heap_thresholds())

    console = Console(stderr=True)
    with Progress(TextColumn("[bold]loading[/] {task.description}"), BarColumn(), TimeElapsedColumn(),
                  transient=True, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task(opts.model, total=None)

        def progress(done: int, total: int, what: str = "") -> None:
            bar.update(task, completed=done, total=total, description=what or opts.model)

        try:
            return load_model(opts, progress=progress)
        except ModelLoadError as exc:
            bar.stop()
            print(f"kvrelay: error: {exc}", file=sys.stderr)
            raise SystemExit(1) from None


def startup_line(role: str, info: dict[str, str], model: str, kv_tokens: int, url: str,
                 kernels_note: str | None = None) -> str:
    """The line a server prints once it serves; `info`: `EngineCore.compute_info()`;
    `kernels_note`: why the torch fallbacks run (`kernels.fallback_reason()`)."""
    where = "" if info["device"] == "cpu" else f"on {info['device']}, "
    notes = "" if info.get("tiles", "none") == "none" else f" (matmuls on {info['tiles']} tiles)"
    notes += f" ({kernels_note})" if kernels_note else ""
    return (f"kvrelay {role}: model {model} ({where}{info['dtype']}, kernels {info['kernels']}{notes}, weights "
            f"{info['weights']}, KV cache {info['kv_cache']}, attention {info['attention']}), "
            f"KV capacity {kv_tokens} tokens, serving on {url}")


def stop_on_sigterm() -> None:
    """Make SIGTERM stop this process like Ctrl-C. uvicorn re-raises the signal that
    stopped it under the handler it found, so with this every `finally` still runs
    (closing the KV segment, aborting legs, stopping child workers) instead of the process
    dying at once."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def serving_url(srv: ServerConfig, sec: SecurityConfig) -> str:
    """The URL a "serving on" line prints: https:// when --ssl-certfile is set, the port
    actually bound (--port 0 picks one). From this call on, the claimed port accepts
    connections (uvicorn serves them as soon as its loop runs), so call it only for the
    line printed once the app is ready."""
    sock = _listening(srv)
    port = sock.getsockname()[1] if sock is not None else srv.port
    host = f"[{srv.host}]" if ":" in srv.host else srv.host
    return f"{'https' if sec.ssl_certfile else 'http'}://{host}:{port}"


def uvicorn_options(srv: ServerConfig, sec: SecurityConfig | None = None) -> dict:
    """The uvicorn settings every serving command shares: where to listen (the socket
    `claim_port` bound, if any); connections bounded and timed by `connections.BoundedHttp`
    (--header-timeout, --body-timeout, --max-connections, --max-connections-per-client,
    --limit-concurrency, each refusal an OpenAI error body), with uvicorn's own
    limit_concurrency off (it counts idle connections and answers text/plain) and its
    --timeout-keep-alive between requests; no WebSockets (no route takes one, and an
    upgraded connection would leave the connection count); HTTPS with
    --ssl-certfile/--ssl-keyfile; and no logging set-up of uvicorn's own: its records go
    through kvrelay's handler (`obs.logs.setup_logging`). Called at start-up: raises the
    open-file limit (`raise_fd_limit`). Request bodies are bounded by the apps themselves
    (`errors.BodyLimit`); who may call them, by `security.Guard`."""
    opts = dict(host=srv.host, port=srv.port, log_level=srv.log_level, access_log=False, log_config=None,
                timeout_keep_alive=srv.timeout_keep_alive, limit_concurrency=None, ws="none",
                http=bounded_protocol(_within_fd_limit(srv)))
    sock = _listening(srv)
    if sock is not None:
        opts["fd"] = sock.fileno()
    if sec is not None and sec.ssl_certfile:
        opts.update(ssl_certfile=sec.ssl_certfile, ssl_keyfile=sec.ssl_keyfile)
    return opts


# Descriptors kept for all but inbound connections (the router's pools to its workers,
# 2 x --max-queued-requests + 144 by default; model files, ZMQ sockets, KV segments),
# at most half the limit.
FD_RESERVE = 1024


@functools.cache
def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (once); the soft limit now
    in force. With --max-connections below it, a connection flood sheds idle connections
    instead of making accept() fail (EMFILE) for everyone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logging.getLogger("kvrelay.startup").warning("open files: cannot raise the limit %d to %d: %s",
                                                         soft, hard, exc)
    return sys.maxsize if soft == resource.RLIM_INFINITY else soft


def _within_fd_limit(srv: ServerConfig) -> ServerConfig:
    limit = raise_fd_limit()
    allowed = max(1, limit - min(FD_RESERVE, limit // 2))
    if srv.max_connections <= allowed:
        return srv
    _warn_clamped(srv.max_connections, allowed, limit)
    return dataclasses.replace(srv, max_connections=allowed)


@functools.cache
def _warn_clamped(asked: int, allowed: int, limit: int) -> None:
    logging.getLogger("kvrelay.startup").warning(
        "--max-connections %d is above what %d open files allow: %d instead (raise `ulimit -n` for more)",
        asked, limit, allowed)


def access_logged(app):
    """`app` with one access line per request (`obs.logs.AccessLog`)."""
    return AccessLog(app)


def run_uvicorn(app, srv: ServerConfig, sec: SecurityConfig | None = None) -> None:
    stop_on_sigterm()
    try:
        uvicorn.run(access_logged(app), **uvicorn_options(srv, sec))
    finally:
        release_ports()

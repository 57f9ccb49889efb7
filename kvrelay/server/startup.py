"""Start-up helpers shared by every serving command: progress bar, startup line, uvicorn."""
from __future__ import annotations

import signal
import sys

import uvicorn
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvrelay.core.config import SecurityConfig, ServerConfig


def load_with_progress(load_model, opts):
    """Load the model with a progress bar on stderr; a load error exits with one line."""
    from kvrelay.engine.loader import ModelLoadError

    with Progress(TextColumn("[bold]loading[/] {task.description}"), BarColumn(), TimeElapsedColumn(),
                  transient=True, console=None) as bar:
        task = bar.add_task(opts.model, total=None)

        def progress(done: int, total: int, what: str = "") -> None:
            bar.update(task, completed=done, total=total, description=what or opts.model)

        try:
            return load_model(opts, progress=progress)
        except ModelLoadError as exc:
            bar.stop()
            print(f"kvrelay: error: {exc}", file=sys.stderr)
            raise SystemExit(1) from None


def startup_line(role: str, loaded, kv_tokens: int, url: str) -> str:
    return f"kvrelay {role}: model {loaded.name} ({loaded.dtype}), KV capacity {kv_tokens} tokens, serving on {url}"


def stop_on_sigterm() -> None:
    """Make SIGTERM stop this process like Ctrl-C. uvicorn re-raises the signal that
    stopped it under the handler it found, so with this every `finally` still runs
    (closing the KV segment, aborting legs, stopping child workers) instead of the process
    dying at once."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def serving_url(srv: ServerConfig, sec: SecurityConfig) -> str:
    """The URL a start-up line prints: https:// when --ssl-certfile is set."""
    return f"{'https' if sec.ssl_certfile else 'http'}://{srv.host}:{srv.port}"


def uvicorn_options(srv: ServerConfig, sec: SecurityConfig | None = None) -> dict:
    """The uvicorn settings every serving command shares: where to listen, the connection
    limits (an idle keep-alive connection is closed after --timeout-keep-alive; beyond
    --limit-concurrency connections and requests, new ones get 503), and HTTPS with
    --ssl-certfile/--ssl-keyfile. Request bodies are bounded by the apps themselves
    (`errors.BodyLimit`); who may call them, by `security.Guard`."""
    opts = dict(host=srv.host, port=srv.port, log_level=srv.log_level, access_log=False,
                timeout_keep_alive=srv.timeout_keep_alive, limit_concurrency=srv.limit_concurrency)
    if sec is not None and sec.ssl_certfile:
        opts.update(ssl_certfile=sec.ssl_certfile, ssl_keyfile=sec.ssl_keyfile)
    return opts


def run_uvicorn(app, srv: ServerConfig, sec: SecurityConfig | None = None) -> None:
    stop_on_sigterm()
    uvicorn.run(app, **uvicorn_options(srv, sec))

"""Operator UX (issue #12): a port in use fails at once and before any model loads, the
"serving on" line is printed only once the port accepts connections, --help shows every
choice and default, --version, one log format (text or json) for kvrelay and uvicorn with
access lines that carry the rid, a Hugging Face id resolved from the local cache only, and
a clear line when the nixl backend is chosen but not installed."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version as dist_version
from pathlib import Path

import httpx
import pytest

from kvrelay.cli import SECTIONS, build_parser, main
from kvrelay.core.config import ClusterConfig, KVRelayConfig, ServerConfig
from kvrelay.obs import logs
from serving_helpers import assert_no_leak, free_port

HF_ID = "kvrelay-test/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")


def kvrelay(*argv: str, python_flags: tuple[str, ...] = (), **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *python_flags, "-m", "kvrelay", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=kw.pop("env", ENV), **kw)


def last_line(text: str) -> str:
    return [ln for ln in text.strip().splitlines() if ln.strip()][-1]


# ---------------------------------------------------------------- ports

def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def taken_port():
    """A port some other process listens on, with the port below it free when drawn (the
    `serve-worker` case puts the prefill worker there; the suite's parallel servers hold
    ports of their own, so the one below a random port is sometimes taken)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            if _free(port - 1):
                yield port
                return
    raise RuntimeError("no listening port with a free port below it in 50 draws")


def test_a_port_in_use_fails_at_once_with_one_line_before_anything_loads(taken_port):
    """Every serving command, with --port taken and a --model that does not exist: the port
    is what it reports (so it was checked first), in one line, exit 1, and torch was never
    imported (python -X importtime lists every import on stderr). `serve` checks its
    workers' fixed ports the same way, before any worker starts."""
    missing = "/nonexistent/model-dir"
    runs = {
        "colocated": ("serve", "--mode", "colocated", "--model", missing, "--port", str(taken_port)),
        "serve": ("serve", "--model", missing, "--port", str(taken_port)),
        "prefill": ("prefill", "--model", missing, "--port", str(taken_port)),
        "decode": ("decode", "--model", missing, "--port", str(taken_port)),
        "router": ("router", "--model", missing, "--port", str(taken_port),
                   "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"),
        # decode worker 0 would take base + 1 (after the one prefill worker)
        "serve-worker": ("serve", "--model", missing, "--port", str(free_port()),
                         "--worker-base-port", str(taken_port - 1)),
    }
    started = time.monotonic()
    procs = {name: kvrelay(*argv, python_flags=("-X", "importtime")) for name, argv in runs.items()}
    results = {name: (p.communicate(timeout=60), p.returncode) for name, p in procs.items()}
    elapsed = time.monotonic() - started
    for name, ((out, err), code) in results.items():
        assert code == 1, (name, err)
        assert "Traceback" not in err and out == "", (name, out, err)
        line = last_line(err)
        assert line.startswith("kvrelay: error: 127.0.0.1:") and "is already in use" in line, (name, err)
        assert f"127.0.0.1:{taken_port} (" in line, (name, line)
        imported = {ln.rsplit("|", 1)[1].strip() for ln in err.splitlines() if ln.startswith("import time:")}
        assert "kvrelay.cli" in imported and "torch" not in imported, name
    assert "decode worker 0's port: --worker-base-port + 1" in results["serve-worker"][0][1]
    assert "starting workers" not in results["serve-worker"][0][1]   # no child was started
    # Six interpreters at once on a shared 2-core machine; one alone takes about half a second.
    assert elapsed < 30, elapsed


def test_serve_gives_workers_fixed_ports_from_the_base():
    from kvrelay.server.errors import StartupError
    from kvrelay.server.startup import worker_ports

    def config(port, **cluster):
        return KVRelayConfig(server=ServerConfig(port=port), cluster=ClusterConfig(**cluster))

    assert worker_ports(config(8000)) == [8001, 8002]
    assert worker_ports(config(8000, num_prefill=2, num_decode=3)) == [8001, 8002, 8003, 8004, 8005]
    assert worker_ports(config(8000, worker_base_port=9100, num_decode=2)) == [9100, 9101, 9102]
    free = worker_ports(config(0, num_decode=2))   # --port 0: any free ports
    assert len(set(free)) == 3 and all(p > 0 for p in free)
    with pytest.raises(StartupError, match="run past 65535"):
        worker_ports(config(65535))
    with pytest.raises(StartupError, match="also a worker's port"):
        worker_ports(config(8001, worker_base_port=8000))


# ---------------------------------------------------------------- --help and --version

def test_help_lists_every_flags_choices_and_default():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    checked = 0
    for command in SECTIONS:
        sub = subparsers[command]
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            help_text = " ".join((action.help or "").split())
            assert "default" in help_text, (command, action.option_strings, help_text)
            for choice in action.choices or ():
                assert f"{{{','.join(action.choices)}}}" in text and choice in help_text, (command, action.dest)
            checked += 1
    assert checked > 100
    serve = " ".join(subparsers["serve"].format_help().split())
    assert "--dtype {auto,float32,bfloat16} compute and KV dtype;" in serve
    assert "(choices: auto, float32, bfloat16; default: auto)" in serve
    from kvrelay.disagg.transfer import TRANSFER_BACKENDS   # the choices are the registry's names
    assert f"--transfer-backend {{{','.join(TRANSFER_BACKENDS.names())}}}" in serve
    assert "(choices: text, json; default: text)" in serve
    assert "--worker-base-port INT" in serve and "default: --port + 1" in serve


def test_version_flag_and_command():
    flag, command = kvrelay("--version"), kvrelay("version")
    out, _ = flag.communicate(timeout=60)
    assert flag.returncode == 0 and out.strip() == f"kvrelay {dist_version('kvrelay')}"
    out, _ = command.communicate(timeout=60)
    lines = out.splitlines()
    assert command.returncode == 0 and lines[0] == f"kvrelay {dist_version('kvrelay')}"
    assert f"torch {dist_version('torch')}" in lines and f"huggingface_hub {dist_version('huggingface_hub')}" in lines


def test_nixl_chosen_but_not_installed_is_one_line(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    monkeypatch.setattr(logs, "setup_logging", lambda *a, **k: None)   # keep this process's logging as it is
    for argv in (["prefill"], ["serve"]):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--transfer-backend", "nixl", "--port", "0"])
        assert exit_.value.code == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "run `make nixl`" in err, err
        assert err.startswith("kvrelay: error: the nixl transfer backend is not installed")


# ---------------------------------------------------------------- log formats and access lines

class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_access_lines_carry_method_path_status_duration_client_and_rid():
    async def app(scope, receive, send):
        assert scope["type"] == "http"
        if scope["path"] == "/boom":
            raise RuntimeError("bug")
        headers = [(b"x-request-id", b"rid-7")] if scope["path"] == "/tagged" else []
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        for chunk in (b"a", b"b"):   # a stream: the line comes after its last byte
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    log = logging.getLogger("test.access")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    sink = Collect()
    log.addHandler(sink)

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=logs.AccessLog(app, log), raise_app_exceptions=False,
                                        client=("10.1.2.3", 4567))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [(await c.post("/tagged")).status_code, (await c.get("/plain")).status_code,
                    (await c.get("/boom")).status_code, (await c.get("/health")).status_code]

    assert asyncio.run(run()) == [201, 201, 500, 201]
    rows = [(r.levelno, r.method, r.path, r.status, r.client, r.rid) for r in sink.records]
    assert rows == [(logging.INFO, "POST", "/tagged", 201, "10.1.2.3:4567", "rid-7"),
                    (logging.INFO, "GET", "/plain", 201, "10.1.2.3:4567", "-"),
                    (logging.INFO, "GET", "/boom", 500, "10.1.2.3:4567", "-"),
                    (logging.DEBUG, "GET", "/health", 201, "10.1.2.3:4567", "-")]   # polled: debug
    assert all(isinstance(r.duration_ms, float) and r.duration_ms >= 0 for r in sink.records)


def test_json_and_text_formats_of_one_record():
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started server process [%d]", (42,), None)
    record.color_message = "\x1b[1mStarted\x1b[0m"   # uvicorn's coloured copy is never written
    record.rid = "cmpl-1"
    obj = json.loads(logs.JsonFormatter().format(record))
    assert (obj["level"], obj["logger"], obj["msg"], obj["rid"]) == ("info", "uvicorn.error",
                                                                     "Started server process [42]", "cmpl-1")
    assert "color_message" not in obj and obj["ts"].endswith("+00:00")
    text = logs.KeyValueFormatter().format(record)
    assert text.endswith(" INFO uvicorn.error Started server process [42] rid=cmpl-1")
    assert text[:4].isdigit()   # timestamped


def test_serve_forwards_worker_lines_as_json_in_json_mode():
    from kvrelay.server.cluster import _json_forwarded

    record = json.loads(_json_forwarded(json.dumps({"level": "info", "msg": "x", "rid": "r1"}), "decode-0"))
    assert record == {"level": "info", "msg": "x", "rid": "r1", "worker": "decode-0"}
    plain = json.loads(_json_forwarded("kvrelay decode: model m, serving on http://127.0.0.1:1", "decode-0"))
    assert plain["msg"].startswith("kvrelay decode: model m") and plain["worker"] == "decode-0"


# ---------------------------------------------------------------- a Hugging Face id from the local cache

def hf_cache(root: Path, model_dir: Path) -> Path:
    """`model_dir` laid out as huggingface_hub's cache holds a download of HF_ID: blobs named
    by content hash, a snapshot of symlinks to them, refs/main naming the snapshot."""
    repo = root / ("models--" + HF_ID.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return root


def test_hf_id_resolves_from_the_local_cache_only(tmp_path, tiny_llama_dir, monkeypatch):
    from huggingface_hub import constants

    from kvrelay.core.config import ModelOptions
    from kvrelay.engine.loader import ModelLoadError, load_tokenizer, model_dir

    cache = hf_cache(tmp_path / "hub", Path(tiny_llama_dir))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    resolved = model_dir(HF_ID)
    assert resolved.parent.name == "snapshots" and resolved.name == REVISION
    assert sorted(p.name for p in resolved.iterdir()) == sorted(p.name for p in Path(tiny_llama_dir).iterdir())
    assert load_tokenizer(ModelOptions(model=HF_ID)).encode("hello") == \
        load_tokenizer(ModelOptions(model=str(tiny_llama_dir))).encode("hello")
    with pytest.raises(ModelLoadError) as miss:
        model_dir("kvrelay-test/not-cached")
    assert "is not in the Hugging Face cache" in str(miss.value) and str(cache) in str(miss.value)
    assert "\n" not in str(miss.value)


def connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


def wait_for(ok, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@contextlib.contextmanager
def stopping(proc: subprocess.Popen):
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_colocated_from_an_hf_id_json_logs_access_rid_and_a_true_serving_line(tmp_path, tiny_llama_dir):
    """One real process: `--model owner/name` from a cache built here (HF_HUB_CACHE), json
    logs. Until the "serving on" line the port refuses connections; right after it, it
    answers. Every stderr line is a JSON object, uvicorn's included, and each request has an
    access line carrying the rid the response was tagged with. Alongside, a second process
    asked for an id that is not cached stops with one line."""
    cache = hf_cache(tmp_path / "hub", Path(tiny_llama_dir))
    env = dict(ENV, HF_HUB_CACHE=str(cache))
    port = free_port()
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay", "serve", "--mode", "colocated", "--model", HF_ID, "--dtype", "float32",
             "--max-kv-tokens", "1024", "--port", str(port), "--log-format", "json"],
            stdout=out, stderr=err, env=env)
    miss = kvrelay("serve", "--mode", "colocated", "--model", "kvrelay-test/not-cached", "--port", "0", env=env)
    with stopping(proc), stopping(miss):
        refused = 0
        deadline = time.monotonic() + 180
        while "serving on" not in out_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            if connects(port):   # it listens only to print the line: that line is due now
                wait_for(lambda: "serving on" in out_path.read_text(), 5)
                break
            refused += 1
            time.sleep(0.05)
        assert connects(port)
        url = f"http://127.0.0.1:{port}"
        models = httpx.get(f"{url}/v1/models", headers={"X-Request-Id": "ux-models-1"}, timeout=30)
        done = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": "ux-complete-1"}, timeout=60,
                          json={"model": HF_ID, "prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert_no_leak(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0

        _, miss_err = miss.communicate(timeout=120)
    assert refused >= 1
    banner = out_path.read_text().strip()
    assert banner.startswith(f"kvrelay colocated: model {HF_ID} (float32, kernels ") and banner.endswith(f"serving on {url}")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == HF_ID
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 3

    records = [json.loads(line) for line in err_path.read_text().splitlines()]   # every line is JSON
    assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)
    assert any(r["logger"] == "uvicorn.error" and r["msg"].startswith("Started server process") for r in records)
    access = {r["path"]: r for r in records if r["logger"] == "kvrelay.access"}
    for path, resp in (("/v1/models", models), ("/v1/completions", done)):
        line = access[path]
        assert line["rid"] == resp.headers.get("x-request-id", "-") != "", line
        assert (line["method"], line["status"]) == (resp.request.method, 200)
        assert line["duration_ms"] >= 0 and line["client"].startswith("127.0.0.1:")

    assert miss.returncode == 1 and "Traceback" not in miss_err
    assert last_line(miss_err).startswith("kvrelay: error: --model 'kvrelay-test/not-cached' does not exist as a "
                                          "local path and is not in the Hugging Face cache")

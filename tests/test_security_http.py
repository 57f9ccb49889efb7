"""Trust boundaries on the HTTP side (issue #10): API keys at the front door (401 with an
OpenAI body, keys from flags or the environment, --protect-metrics), the per-key cap on
requests in flight (429), the cluster token on workers' HTTP APIs and the router that
presents it, the bind rules that keep a keyless worker on loopback, `kvrelay keygen`, and
what `kvrelay serve` hands its children. Apps run in this process (httpx's ASGI
transport) on the tiny random Llama; one test starts a real worker process."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI

from kvrelay.cli import build_parser, config_from_args, main
from kvrelay.core.config import (KVCacheConfig, KVRelayConfig, LifecycleConfig, RouterConfig, SchedulerConfig,
                                 SecurityConfig, ServerConfig, TransferConfig)
from kvrelay.core.keys import ENV as KEY_ENV
from kvrelay.core.keys import ClusterKey
from kvrelay.engine import kernels
from kvrelay.obs.metrics import ServingMetrics
from kvrelay.server.errors import OpenAIError, StartupError, install_handlers
from kvrelay.server.security import Gate, api_gate, auth_headers, check_worker, guard, load_cluster_key, worker_gate
from kvrelay.server.worker_client import WRONG_KEY
from serving_helpers import assert_no_leak, call_asgi, free_port, wait_healthy

pytestmark = pytest.mark.anyio
ERROR_KEYS = {"message", "type", "param", "code"}
C = "/v1/completions"
OK_C = {"prompt": "hi", "max_tokens": 2}


@asynccontextmanager
async def client(app, key: str | None = None, base_url: str = "http://kvrelay"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url=base_url, headers=headers, timeout=60) as c:
        yield c


def assert_401(r: httpx.Response, code: str = "invalid_api_key") -> str:
    """An OpenAI-style 401 (the body OpenAI sends for a bad API key); its message."""
    assert r.status_code == 401, (r.request.url, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"], err
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, code), err
    return err["message"]


def colocated(engine, sec: SecurityConfig, environ: dict[str, str] | None = None):
    from kvrelay.server.colocated import colocated_app

    return colocated_app(engine, api_gate(sec, environ or {}))


# ---------------------------------------------------------------- the front door: API keys

async def test_without_an_api_key_nothing_changes(tiny_engine):
    app = colocated(tiny_engine, SecurityConfig())
    async with client(app) as c:
        assert (await c.get("/v1/models")).status_code == 200
        assert (await c.post(C, json=OK_C)).status_code == 200
        assert (await c.get("/debug/requests")).status_code == 200
        assert (await c.get("/no/such/path")).status_code == 404
    tiny_engine.check_idle()


PROTECTED = [("GET", "/v1/models"), ("POST", C), ("POST", "/v1/chat/completions"), ("GET", "/debug/requests"),
             ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/path"), ("DELETE", "/v1/models")]


async def test_with_api_keys_every_route_but_health_and_metrics_needs_one(tiny_engine):
    """Unknown paths are 401 too: a caller without a key learns nothing about the routes.
    Each of several keys works; a wrong one, another scheme or an empty one does not."""
    app = colocated(tiny_engine, SecurityConfig(api_key=("key-one", "key-two")))
    async with client(app) as c:
        for method, path in PROTECTED:
            assert "No API key provided" in assert_401(await c.request(method, path, json=OK_C))
            for header in ("Bearer key-three", "Bearer key-one-and-more", "Basic key-one", "Bearer ", "key-one"):
                r = await c.request(method, path, json=OK_C, headers={"Authorization": header})
                assert_401(r)
        # A body over the size limit is refused as unauthenticated before it is read.
        assert_401(await c.post(C, content=b"x" * (5 << 20), headers={"content-type": "application/json"}))
        assert (await c.get("/health")).json()["status"] == "ok"
        assert (await c.get("/metrics")).status_code == 200
    for key in ("key-one", "key-two"):
        async with client(app, key) as c:
            r = await c.post(C, json=OK_C)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
            assert (await c.get("/v1/models")).json()["data"][0]["id"] == tiny_engine.model_name
            assert (await c.get("/debug/requests")).json()["count"] == 0
            assert (await c.get("/no/such/path")).status_code == 404   # with a key: the usual 404
            assert "Incorrect API key" in assert_401(await c.get("/v1/models", headers={"Authorization": "Bearer x"}))
    tiny_engine.check_idle()


async def test_the_openapi_schema_stays_clean(tiny_engine):
    """The check is middleware: no route grows an Authorization parameter."""
    app = colocated(tiny_engine, SecurityConfig(api_key=("k" * 20,)))
    async with client(app, "k" * 20) as c:
        schema = (await c.get("/openapi.json")).json()
    assert C in schema["paths"]
    assert "authorization" not in json.dumps(schema).lower()


async def test_protect_metrics_puts_health_and_metrics_behind_the_key(tiny_engine):
    app = colocated(tiny_engine, SecurityConfig(api_key=("sekrit",), protect_metrics=True))
    async with client(app) as c:
        for path in ("/health", "/metrics", "/v1/models"):
            assert_401(await c.get(path))
    async with client(app, "sekrit") as c:
        for path in ("/health", "/metrics", "/v1/models"):
            assert (await c.get(path)).status_code == 200
    with pytest.raises(StartupError, match="--protect-metrics needs an API key"):
        api_gate(SecurityConfig(protect_metrics=True), {})


def test_api_keys_come_from_the_flags_or_else_the_environment():
    assert api_gate(SecurityConfig(), {}).tokens == ()
    assert api_gate(SecurityConfig(), {"KVRELAY_API_KEY": "alpha, beta,,gamma "}).tokens == ("alpha", "beta", "gamma")
    assert api_gate(SecurityConfig(api_key=("flag",)), {"KVRELAY_API_KEY": "env"}).tokens == ("flag",)
    with pytest.raises(StartupError, match="KVRELAY_API_KEY holds no key"):
        api_gate(SecurityConfig(), {"KVRELAY_API_KEY": " , "})
    config = config_from_args(build_parser().parse_args(["router", "--prefill", "http://a:1", "--decode", "http://b:2",
                                                         "--api-key", "a", "--api-key", "b", "c"]))
    assert config.security.api_key == ("a", "b", "c")
    with pytest.raises(SystemExit):   # workers face no client: they take no API key
        build_parser().parse_args(["decode", "--api-key", "a"])


async def test_api_keys_from_the_environment_guard_the_app(tiny_engine):
    app = colocated(tiny_engine, SecurityConfig(), {"KVRELAY_API_KEY": "env-key-1,env-key-2"})
    async with client(app) as c:
        assert_401(await c.get("/v1/models"))
    async with client(app, "env-key-2") as c:
        assert (await c.get("/v1/models")).status_code == 200


# ---------------------------------------------------------------- --max-streams-per-key

def held_app(gate: Gate):
    """An app whose POST /v1/completions answers only once `release` is set; `entered`
    counts the requests inside it."""
    app = FastAPI()
    install_handlers(app)
    guard(app, gate)
    state = {"entered": 0, "release": asyncio.Event()}

    @app.post(C)
    async def hold() -> dict:
        state["entered"] += 1
        await state["release"].wait()
        return {"ok": True}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    return app, state


async def until(check, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def assert_429(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["code"] == "rate_limit_exceeded" and "--max-streams-per-key 2" in err["message"]


async def test_each_key_has_its_own_bucket_of_requests_in_flight():
    app, state = held_app(Gate(("key-a", "key-b"), max_streams=2))
    async with client(app, "key-a") as a, client(app, "key-b") as b:
        held = [asyncio.create_task(a.post(C, json={})) for _ in range(2)]
        await until(lambda: state["entered"] == 2)
        assert_429(await a.post(C, json={}))
        assert (await a.get("/v1/models")).status_code == 200   # only POSTs (completions) count
        held += [asyncio.create_task(b.post(C, json={})) for _ in range(2)]   # key-b: a bucket of its own
        await until(lambda: state["entered"] == 4)
        assert_429(await b.post(C, json={}))
        state["release"].set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 4
        # The slots came back with the responses.
        assert [r.status_code for r in await asyncio.gather(*(a.post(C, json={}) for _ in range(2)))] == [200, 200]


async def test_without_api_keys_every_client_shares_one_bucket():
    app, state = held_app(Gate((), max_streams=2))
    async with client(app) as one, client(app) as two:
        held = [asyncio.create_task(one.post(C, json={})), asyncio.create_task(two.post(C, json={}))]
        await until(lambda: state["entered"] == 2)
        r = await two.post(C, json={})
        assert_429(r)
        assert "all clients together" in r.json()["error"]["message"]
        state["release"].set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
async def test_a_slot_comes_back_when_the_client_leaves_mid_stream(tiny_engine, spec):
    app = colocated(tiny_engine, SecurityConfig(api_key=("streamer",), max_streams_per_key=1))
    for _ in range(2):   # with one slot, the second stream starts only if the first gave its slot back
        body = {"prompt": "Tell me everything", "max_tokens": 900, "ignore_eos": True, "stream": True}
        sent = await call_asgi(app, C, body, disconnect_after_chunks=2, spec=spec,
                               headers={"Authorization": "Bearer streamer"})
        assert sent[0]["status"] == 200
        assert b"".join(m.get("body", b"") for m in sent[1:]).count(b"data: ") < 900
    async with client(app, "streamer") as c:
        r = await c.post(C, json={**OK_C, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
        assert (await c.post(C, json=OK_C)).status_code == 200
    tiny_engine.check_idle()


# ---------------------------------------------------------------- workers: the cluster token

KEY = ClusterKey(b"0123456789abcdef0123456789abcdef", "test")
KV = KVCacheConfig(page_size=16, max_kv_tokens=2048)
SCHED = SchedulerConfig(max_running_requests=16, max_prefill_tokens=512)
LIFE = LifecycleConfig(heartbeat_interval=0.2, heartbeat_misses=3, bootstrap_timeout=10, queue_timeout=10,
                       waiting_timeout=10, transfer_timeout=10, quarantine_grace=0.5)
URLS = {"prefill": "http://prefill-0:8100", "decode": "http://decode-0:8200"}


@pytest.fixture(scope="module")
def engines(tiny_loaded):
    """A prefill and a decode worker core (shm) in this process."""
    from kvrelay.disagg.decode_worker import DecodeCore
    from kvrelay.disagg.prefill_worker import PrefillCore
    from kvrelay.engine.engine import AsyncEngine

    tc = TransferConfig(transfer_backend="shm")
    made = {"prefill": AsyncEngine(lambda: PrefillCore(tiny_loaded, KV, SCHED, LIFE, tc)),
            "decode": AsyncEngine(lambda: DecodeCore(tiny_loaded, KV, SCHED, LIFE, tc))}
    yield made
    for engine in made.values():
        engine.shutdown()
        engine.core.close()


def worker_apps(engines, sec: SecurityConfig = SecurityConfig(), key: ClusterKey | None = KEY) -> dict:
    from kvrelay.server.worker_app import worker_app

    apps = {}
    for role, engine in engines.items():
        metrics = ServingMetrics(role, type(engine.core).PHASES, lambda e=engine: e.call(lambda c: c.snapshot()))
        apps[role] = worker_app(engine, metrics, faults=True, gate=worker_gate(key, sec))
    return apps


class Workers(httpx.AsyncBaseTransport):
    """The network between the router and in-process worker apps, by URL host."""

    def __init__(self, apps: dict) -> None:
        self.by_host = {httpx.URL(URLS[role]).host: httpx.ASGITransport(app) for role, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.by_host[request.url.host].handle_async_request(request)


def leg(rid: str, room: int) -> dict:
    return {"rid": rid, "room": room, "prompt_ids": [3, 4, 5, 6], "sampling": {"max_tokens": 3}}


async def test_a_worker_with_a_key_answers_only_the_routers_token(engines):
    """Every route but /health and /metrics needs the token: /generate, /abort,
    /debug/requests, /debug/faults, unknown paths. /health says whether the caller's
    token was right, so a router with the wrong key can say so."""
    prefill = worker_apps(engines)["prefill"]
    token = KEY.http_token
    for key in (None, "wrong-token", ClusterKey(b"another key of 32 bytes, or so..").http_token):
        async with client(prefill, key) as w:
            for method, path, body in (("POST", "/generate", leg("nope", 11)), ("POST", "/abort", {"rid": "nope"}),
                                       ("GET", "/debug/requests", None), ("POST", "/debug/faults", {"spec": ""}),
                                       ("GET", "/no/such/path", None)):
                assert_401(await w.request(method, path, json=body), code="invalid_token")
            health = await w.get("/health")
            assert health.status_code == 200 and health.json()["auth"] == "refused"
            assert (await w.get("/metrics")).status_code == 200
    async with client(prefill, token) as w:
        health = (await w.get("/health")).json()
        assert health["auth"] == "ok" and health["kernels"] in kernels.available_isas()
        assert health["dtype"] in ("float32", "bfloat16") and health["weights"]
        assert (await w.post("/abort", json={"rid": "nope"})).json() == {"aborted": False}
        assert (await w.get("/debug/requests")).json()["count"] == 0
        assert (await w.post("/debug/faults", json={"spec": ""})).json() == {"spec": ""}
        bad = await w.post("/generate", json={**leg("bad", 12), "room": 0})   # past the gate: validation
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "room"
    for engine in engines.values():
        engine.check_idle(timeout=15)


async def test_a_worker_without_a_key_is_open_and_protect_metrics_closes_health(engines):
    async with client(worker_apps(engines, key=None)["decode"]) as w:
        assert (await w.get("/health")).json()["auth"] == "off"
        assert (await w.get("/debug/requests")).status_code == 200
    async with client(worker_apps(engines, SecurityConfig(protect_metrics=True))["decode"]) as w:
        for path in ("/health", "/metrics"):
            assert_401(await w.get(path), code="invalid_token")
        assert (await w.get("/health", headers=auth_headers(KEY))).json()["auth"] == "ok"
        assert (await w.get("/metrics", headers=auth_headers(KEY))).status_code == 200


@asynccontextmanager
async def router(tiny_loaded, apps: dict, key: ClusterKey | None, gate: Gate | None = None):
    """A RouterClient and its app (as `run_router` builds them) over in-process workers."""
    from kvrelay.core.clock import MonotonicClock
    from kvrelay.server.pairing import WorkerTable
    from kvrelay.server.router import RouterClient, router_app
    from kvrelay.server.worker_client import WorkerAPI, WorkerMonitor

    cfg = RouterConfig(prefill=(URLS["prefill"],), decode=(URLS["decode"],), health_timeout=5.0)
    api = WorkerAPI(cfg, Workers(apps), headers=auth_headers(key))
    clock = MonotonicClock()
    table = WorkerTable(cfg.prefill, cfg.decode, clock)
    monitor = WorkerMonitor(table, api, cfg)
    try:
        await monitor.check_all()
        rc = RouterClient(cfg, table, api, monitor, tiny_loaded.tokenizer, tiny_loaded.name, 512, clock)
        try:
            yield rc, router_app(rc, gate)
        finally:
            await rc.close()
    finally:
        await api.close()


async def test_the_router_presents_the_token_on_every_call(engines, tiny_loaded):
    """Health checks, legs and the aggregated debug view all reach keyed workers; the
    router's own routes (/workers too) are behind its API key."""
    apps = worker_apps(engines)
    async with router(tiny_loaded, apps, KEY, api_gate(SecurityConfig(api_key=("front",)), {})) as (rc, app):
        assert [w["up"] for w in rc.table.rows()] == [True, True], rc.table.rows()
        async with client(app) as c:
            for path in ("/workers", "/debug/requests", "/v1/models"):
                assert_401(await c.get(path))
        async with client(app, "front") as c:
            r = await c.post(C, json={"prompt": "through the router", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
            view = (await c.get("/debug/requests")).json()
            assert set(view["workers"]) == set(URLS.values())
            assert all("error" not in w and w["requests"] == [] for w in view["workers"].values()), view
            assert [w["up"] for w in (await c.get("/workers")).json()["workers"]] == [True, True]
    for engine in engines.values():
        engine.check_idle(timeout=15)


@pytest.mark.parametrize("sec", [SecurityConfig(), SecurityConfig(protect_metrics=True)], ids=["open", "protected"])
@pytest.mark.parametrize("router_key", [None, ClusterKey(b"not the workers' key, 32 bytes..")], ids=["none", "other"])
async def test_a_router_without_the_workers_key_keeps_them_down_saying_why(engines, tiny_loaded, sec, router_key):
    async with router(tiny_loaded, worker_apps(engines, sec), router_key) as (rc, _):
        rows = rc.table.rows()
        assert [w["up"] for w in rows] == [False, False], rows
        assert all(WRONG_KEY in json.dumps(w) for w in rows), rows
        with pytest.raises(OpenAIError) as refused:
            [o async for o in rc.generate(token_request())]
        assert (refused.value.status, refused.value.code) == (503, "no_healthy_worker")
    for engine in engines.values():
        engine.check_idle(timeout=15)


def token_request():
    from kvrelay.engine.types import GenerateRequest, SamplingParams

    return GenerateRequest("r-nokey", (11, 12, 13), SamplingParams(max_tokens=2))


# ---------------------------------------------------------------- where a worker may listen

def worker_config(host: str = "127.0.0.1", transfer_host: str = "127.0.0.1", faults: bool = False,
                  **security) -> KVRelayConfig:
    return dataclasses.replace(KVRelayConfig(), server=ServerConfig(host=host),
                               transfer=TransferConfig(transfer_host=transfer_host, enable_fault_injection=faults),
                               security=SecurityConfig(**security))


@pytest.mark.parametrize("host,transfer_host", [("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "10.0.0.5"),
                                                ("::", "127.0.0.1"), ("example.com", "127.0.0.1")])
def test_a_worker_without_a_key_stays_on_loopback(host, transfer_host):
    with pytest.raises(StartupError, match="without a cluster key") as err:
        check_worker(worker_config(host, transfer_host), "decode", None)
    assert "--cluster-key-file or KVRELAY_CLUSTER_KEY" in str(err.value) and "kvrelay keygen" in str(err.value)
    check_worker(worker_config(host, transfer_host), "decode", KEY)   # a key allows any bind
    for loop in ("127.0.0.1", "localhost", "::1"):
        check_worker(worker_config(loop, loop), "decode", None)


def test_fault_injection_beyond_loopback_needs_a_key():
    with pytest.raises(StartupError, match="needs --host and --transfer-host on loopback"):
        check_worker(worker_config("0.0.0.0", faults=True), "prefill", None)
    check_worker(worker_config("0.0.0.0", "10.0.0.5", faults=True), "prefill", KEY)
    check_worker(worker_config(faults=True), "prefill", None)
    with pytest.raises(StartupError, match="needs --enable-fault-injection"):
        check_worker(dataclasses.replace(worker_config(), transfer=TransferConfig(fault_spec="drop_ack=1")),
                     "prefill", KEY)
    with pytest.raises(StartupError, match="--protect-metrics on a worker needs a cluster key"):
        check_worker(worker_config(protect_metrics=True), "prefill", None)


def test_the_cluster_key_comes_from_the_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert load_cluster_key(SecurityConfig()) is None
    monkeypatch.setenv(KEY_ENV, "k" * 40)
    assert load_cluster_key(SecurityConfig()).http_token == ClusterKey(b"k" * 40).http_token
    path = tmp_path / "cluster.key"
    path.write_text("f" * 64 + "\n")
    assert load_cluster_key(SecurityConfig(cluster_key_file=str(path))).http_token == ClusterKey(b"f" * 64).http_token
    with pytest.raises(StartupError, match="cannot read --cluster-key-file"):
        load_cluster_key(SecurityConfig(cluster_key_file=str(tmp_path / "missing")))
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(StartupError, match="at least 16"):
        load_cluster_key(SecurityConfig())


def test_keygen_prints_a_new_key_each_time(capsys, tmp_path):
    keys = []
    for _ in range(2):
        main(["keygen"])
        keys.append(capsys.readouterr().out)
    assert keys[0] != keys[1]
    for key in keys:
        assert key.endswith("\n") and len(key.strip()) == 64 and int(key, 16) >= 0
    path = tmp_path / "cluster.key"
    path.write_text(keys[0])
    assert ClusterKey.load(str(path), {}).export() == keys[0].strip()


def test_serve_hands_its_workers_the_key_by_file_or_environment_never_on_the_command_line(tmp_path):
    from kvrelay.server.cluster import worker_argv, worker_env

    key = ClusterKey.generate()
    sec = SecurityConfig(api_key=("front",), max_streams_per_key=3, protect_metrics=True, replay_window=30.0,
                         ssl_certfile="/c.pem", ssl_keyfile="/k.pem", ssl_ca_certs="/ca.pem")
    config = dataclasses.replace(KVRelayConfig(), security=sec)
    argv = worker_argv(config, "decode", 4321)
    again = config_from_args(build_parser().parse_args(argv[3:]))
    assert again.security == SecurityConfig(protect_metrics=True, replay_window=30.0)   # no API keys, no TLS
    assert key.export() not in " ".join(argv)
    assert worker_env(key, sec, 1)[KEY_ENV] == key.export()
    with_file = dataclasses.replace(sec, cluster_key_file=str(tmp_path / "cluster.key"))
    argv = worker_argv(dataclasses.replace(config, security=with_file), "prefill", 4321)
    assert argv[argv.index("--cluster-key-file") + 1] == with_file.cluster_key_file
    assert KEY_ENV not in worker_env(key, with_file, 1)


# ---------------------------------------------------------------- real processes

def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}   # no cluster key
    return subprocess.run([sys.executable, "-m", "kvrelay", *argv], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.parametrize("args", [["decode", "--host", "0.0.0.0"], ["prefill", "--transfer-host", "0.0.0.0"]])
def test_a_worker_without_a_key_refuses_a_non_loopback_bind_with_one_line(args):
    proc = run_cli(*args)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("kvrelay: error: the ") and "without a cluster key" in lines[-1], proc.stderr
    assert "KVRELAY_CLUSTER_KEY" in lines[-1] and "Traceback" not in proc.stderr


def test_a_worker_process_with_a_key_listens_anywhere_and_needs_the_token(tiny_llama_dir, tmp_path):
    """`kvrelay prefill --host 0.0.0.0` with KVRELAY_CLUSTER_KEY: /generate, /abort,
    /debug/requests and /debug/faults are 401 without the token and served with it;
    /health and /metrics answer anyone."""
    port, key = free_port(), ClusterKey.generate()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "prefill.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               KVRELAY_CLUSTER_KEY=key.export())
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvrelay", "prefill", "--model", f"random:{tiny_llama_dir}",
                                 "--dtype", "float32", "--max-kv-tokens", "2048", "--transfer-backend", "tcp",
                                 "--host", "0.0.0.0", "--port", str(port), "--enable-fault-injection"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, url, 180, lambda: log.read_text(errors="replace"))
        calls = [("POST", "/generate", {**leg("r", 5), "room": 0}), ("POST", "/abort", {"rid": "r"}),
                 ("GET", "/debug/requests", None), ("POST", "/debug/faults", {"spec": ""})]
        with httpx.Client(base_url=url, timeout=30) as anon, \
                httpx.Client(base_url=url, timeout=30, headers=auth_headers(key)) as router:
            for method, path, body in calls:
                assert_401(anon.request(method, path, json=body), code="invalid_token")
            assert anon.get("/health").json()["auth"] == "refused"
            assert anon.get("/metrics").status_code == 200
            got = [router.request(method, path, json=body) for method, path, body in calls]
            assert [r.status_code for r in got] == [400, 200, 200, 200], [r.text for r in got]
            assert got[0].json()["error"]["param"] == "room"   # past the gate, refused by validation
            assert router.get("/health").json()["auth"] == "ok"
        assert_no_leak(url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(errors="replace")

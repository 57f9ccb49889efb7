"""Metrics as Prometheus and Grafana read them.

- A real Prometheus (Debian's package) scrapes a running cluster (router + 1 prefill + 1
  decode worker, tiny random model) through the shipped deploy/prometheus/prometheus.yml:
  after some traffic, every PromQL expression of deploy/grafana/kvrelay.json and of
  deploy/prometheus/alerts.yml evaluates without error and returns data. An alert is
  empty on a healthy cluster, so for each rule (all written `<signal> <op> <threshold>`)
  the full expression must evaluate and its signal must return data; Prometheus must
  also report every rule healthy.
- `promtool check metrics` passes on every role's /metrics, colocated included: the only
  lint it reports is on the vllm: names, which are vLLM's own (':' is legal, recording-
  rule style) and which it reports on vLLM's /metrics alike.
- The counters mean what they say: tokens, requests, one level per vllm: series.
- deploy/grafana/kvrelay.json fits Grafana's dashboard model, as Grafana Labs generate it
  from Grafana's schema into typed models (grafana-foundation-sdk, Grafana 11.6): every
  field decodes into the model, with the model's types, and nothing is dropped.
"""
from __future__ import annotations

import asyncio
import enum
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import typing
from pathlib import Path

import httpx
import pytest
import yaml

from cluster_helpers import Cluster
from serving_helpers import free_port, gauge, metric_samples

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvrelay.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
# Grafana's template variables, as the test sets them: every job, every model.
VARIABLES = {"$__rate_interval": "1m", "$job": ".+", "$model_name": ".+"}
THRESHOLD = re.compile(r"(?P<signal>.+?)\s*(==|!=|>=|<=|>|<)\s*-?[0-9.]+(e[-+]?[0-9]+)?\s*", re.S)
VLLM_LINT = re.compile(r"vllm:\S+ metric names should not contain ':'")


# ---------------------------------------------------------------- tools

def prometheus_tool(name: str) -> str:
    """`name` (prometheus or promtool) from Debian's package, installed here if missing
    (make test installs it first: tests/../Makefile)."""
    path = shutil.which(name)
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
            subprocess.run(install, env=env, capture_output=True, timeout=600)
        path = shutil.which(name)
    assert path, f"{name} is missing: install Debian's prometheus package (`make test` does)"
    return path


def promtool_problems(text: str) -> list[str]:
    r = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    problems = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode in (0, 3), problems   # 3: lint problems; anything else: it could not read the text
    return problems


def assert_promtool_clean(text: str) -> None:
    """promtool finds nothing in kvrelay's series, and in the vllm: ones only their names."""
    assert [p for p in promtool_problems(text) if not VLLM_LINT.fullmatch(p)] == []
    own = "".join(line + "\n" for line in text.splitlines() if not re.match(r"(# (HELP|TYPE) )?vllm:", line))
    assert promtool_problems(own) == []
    assert "_created" not in text


def families(text: str) -> set[str]:
    """The families with samples (a labelled histogram never observed has only its header)."""
    return {f.name for f in _parse(text) if f.samples}


# ---------------------------------------------------------------- Grafana's schema

class SchemaError(AssertionError):
    pass


def _is_model(value) -> bool:
    return hasattr(type(value), "from_json") and hasattr(value, "to_json")


def _check(value, hint, path: str) -> None:
    """`value` (decoded by the SDK, which does not check types) against `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (typing.Any, object):
        if _is_model(value):
            _check_model(value, path)
    elif origin is typing.Union:
        arms = [a for a in args if a is not type(None)]
        if value is None and len(arms) < len(args):
            return
        errors = []
        for arm in arms:
            try:
                return _check(value, arm, path)
            except SchemaError as exc:
                errors.append(exc)
        raise max(errors, key=lambda e: len(str(e).split(":")[0]))   # the arm that got furthest
    elif origin is typing.Literal:
        if value not in args:
            raise SchemaError(f"{path}: {value!r} is not one of {args}")
    elif origin in (list, dict):
        if not isinstance(value, origin):
            raise SchemaError(f"{path}: {value!r:.60} is not a {origin.__name__}")
        items = enumerate(value) if origin is list else value.items()
        for key, item in items:
            _check(item, args[-1], f"{path}[{key!r}]")
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        if value not in {m.value for m in hint}:
            raise SchemaError(f"{path}: {value!r} is not a {hint.__name__}")
    elif hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float) if hint is float else int):
            raise SchemaError(f"{path}: {value!r} is not a{'n integer' if hint is int else ' number'}")
    elif not isinstance(value, hint):
        raise SchemaError(f"{path}: {value!r:.60} is not a {hint.__name__}")
    elif _is_model(value):
        _check_model(value, path)


def _check_model(obj, path: str) -> None:
    from grafana_foundation_sdk.cog.runtime import UnknownDataquery

    if isinstance(obj, UnknownDataquery):
        raise SchemaError(f"{path}: a query of no datasource type the schema knows")
    for name, hint in typing.get_type_hints(type(obj)).items():
        _check(getattr(obj, name), hint, f"{path}.{name}")


def _dropped(orig, back, path: str = "$") -> list[str]:
    """What of `orig` did not survive a decode and encode (fields the model lacks)."""
    if isinstance(orig, dict):
        if not isinstance(back, dict):
            return [f"{path}: became {back!r:.60}"]
        return [e for k, v in orig.items()
                for e in (_dropped(v, back[k], f"{path}.{k}") if k in back else [f"{path}.{k}: not in the schema"])]
    if isinstance(orig, list):
        if not isinstance(back, list) or len(back) != len(orig):
            return [f"{path}: the list changed"]
        return [e for i, (a, b) in enumerate(zip(orig, back)) for e in _dropped(a, b, f"{path}[{i}]")]
    return [] if orig == back else [f"{path}: {orig!r} became {back!r}"]


def check_dashboard(data: dict) -> None:
    """Raise SchemaError unless `data` is a dashboard of Grafana's model."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()   # panel options and queries decode into their plugin's model
    try:
        dashboard = Dashboard.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SchemaError(f"does not decode: {type(exc).__name__}: {exc}") from None
    _check_model(dashboard, "$")
    lost = _dropped(data, json.loads(json.dumps(dashboard, cls=JSONEncoder)))
    if lost:
        raise SchemaError("; ".join(lost))


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the shipped dashboard."""
    data = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in data["panels"] for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def with_variables(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def test_dashboard_fits_grafanas_dashboard_model():
    check_dashboard(json.loads(DASHBOARD.read_text()))


def _set(path: list, value):
    def mutate(d: dict) -> None:
        node = d
        for key in path[:-1]:
            node = node[key]
        if value is KeyError:
            node[path[-1] + "x"] = node.pop(path[-1])
        else:
            node[path[-1]] = value
    return mutate


@pytest.mark.parametrize("mutate,where", [
    (_set(["panels", 1, "gridPos", "h"], "8"), "grid_pos.h"),                   # a string for an integer
    (_set(["panels", 1, "targets", 0, "expr"], KeyError), "exprx"),             # a field the query lacks
    (_set(["panels", 1, "options", "legend", "placement"], "middle"), "placement"),   # not one of the enum
    (_set(["panels", 1, "targets", 0, "range"], "yes"), "range"),           # a string for a bool
    (_set(["panels", 1, "fieldConfig", "defaults", "unit"], 5), "unit"),     # a number for a string
    (_set(["templating", "list", 1, "refresh"], "sometimes"), "refresh"),
])
def test_the_schema_check_catches_mistakes(mutate, where):
    data = json.loads(DASHBOARD.read_text())
    mutate(data)
    with pytest.raises(SchemaError, match=where):
        check_dashboard(data)


def test_dashboard_shows_the_pd_view():
    exprs = " ".join(e for _, e in dashboard_queries())
    for needed in ("kvrelay_requests{", "kvrelay_oldest_request_age_seconds", 'outcome!="success"',
                   "kvrelay_transfer_bytes_total", "kvrelay_transfer_seconds_total", "kvrelay_kv_pages_quarantined",
                   "kvrelay_time_to_first_token_seconds_bucket", "kvrelay_time_per_output_token_seconds_bucket",
                   "kvrelay_kv_pages_capacity", "kvrelay_requests_finished_total", "process_cpu_seconds_total"):
        assert needed in exprs, needed
    by_title = {t: e for t, e in dashboard_queries()}
    assert "sum by (role, reason)" in by_title["Failures by reason"]
    assert "sum by (role, phase)" in by_title["Live requests by role and phase"]
    assert all("histogram_quantile" in e for t, e in dashboard_queries() if t == "Time to first token")


def test_every_alert_is_signal_op_threshold():
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {"KvrelayRequestStuck", "KvrelayQuarantineGrowing", "KvrelayWorkerDown"}
    for rule in rules:
        assert THRESHOLD.fullmatch(rule["expr"]), rule["alert"]


def test_promtool_accepts_the_rules_and_the_scrape_config():
    promtool = prometheus_tool("promtool")
    for args in (["check", "rules", str(ALERTS)], ["check", "config", str(SCRAPE_CONFIG)]):
        r = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- colocated, in process

def test_colocated_metrics(tiny_engine):
    from kvrelay.server.colocated import colocated_app

    app = colocated_app(tiny_engine)

    async def run() -> tuple[dict, str, str]:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvrelay", timeout=60) as c:
            before = (await c.get("/metrics")).text
            r = await c.post("/v1/completions", json={"prompt": "the metrics of one request", "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            # a scrape renders the state the engine published after its last iteration
            return r.json()["usage"], before, (await c.get("/metrics")).text

    usage, before, after = asyncio.run(run())
    assert_promtool_clean(after)

    def value(text: str, name: str) -> float:
        return sum(s.value for f in _parse(text) for s in f.samples if s.name == name)

    for name, want in (("vllm:prompt_tokens_total", usage["prompt_tokens"]),
                       ("vllm:generation_tokens_total", usage["completion_tokens"]),
                       ("kvrelay_generation_tokens_total", usage["completion_tokens"]),
                       ("vllm:request_success_total", 1), ("vllm:time_to_first_token_seconds_count", 1),
                       ("vllm:e2e_request_latency_seconds_count", 1), ("vllm:request_queue_time_seconds_count", 1),
                       ("vllm:inter_token_latency_seconds_count", usage["completion_tokens"] - 1)):
        assert value(after, name) - value(before, name) == want, name
    # The first token comes from the prompt's one pass; each later one from a decode step of
    # this one sequence.
    for name, want in (("kvrelay_engine_prefill_passes_total", 1),
                       ("kvrelay_engine_prefill_tokens_total", usage["prompt_tokens"]),
                       ("kvrelay_engine_decode_steps_total", usage["completion_tokens"] - 1),
                       ("kvrelay_engine_decode_sequences_total", usage["completion_tokens"] - 1)):
        assert value(after, name) - value(before, name) == want, name
    for name in ("kvrelay_engine_prefill_seconds_total", "kvrelay_engine_decode_seconds_total"):
        assert value(after, name) > value(before, name), name
    assert 'model_name="tiny-llama"' in after
    assert {"kvrelay_kv_pages_capacity", "vllm:kv_cache_usage_perc", "process_cpu_seconds"} <= families(after)
    assert value(after, "kvrelay_kv_pages_free") == value(after, "kvrelay_kv_pages_capacity") > 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0


def _parse(text: str):
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


# ---------------------------------------------------------------- the router's re-export, fake workers

FAKE = {"http://p:1": ("prefill", "# HELP kvrelay_kv_pages_free Free KV pages\n# TYPE kvrelay_kv_pages_free gauge\n"
                                   'kvrelay_kv_pages_free{role="prefill",model_name="m"} 7.0\n'),
        "http://d:2": ("decode", None),                  # its /metrics fails
        "http://d:3": ("decode", "this is not the text format {\n")}


def fake_worker(request: httpx.Request) -> httpx.Response:
    from kvrelay.server.worker_protocol import WorkerHealth

    url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
    role, text = FAKE[url]
    if request.url.path == "/health":
        return httpx.Response(200, json=WorkerHealth(role=role, worker_id=url, incarnation="1", model="m",
                                                     max_model_len=64, transfer_backend="shm",
                                                     transfer_address="tcp://127.0.0.1:9", live_requests=0,
                                                     queued_requests=0, free_pages=7, total_pages=7).model_dump())
    if request.url.path == "/metrics" and text is not None:
        return httpx.Response(200, text=text)
    return httpx.Response(500, text="no")


@pytest.mark.parametrize("protect", [False, True])
def test_router_reexport_labels_workers_and_is_as_open_as_metrics(protect):
    from kvrelay.core.clock import MonotonicClock
    from kvrelay.core.config import RouterConfig, SecurityConfig
    from kvrelay.server.pairing import WorkerTable
    from kvrelay.server.router import RouterClient, router_app
    from kvrelay.server.security import api_gate
    from kvrelay.server.worker_client import WorkerAPI, WorkerMonitor

    async def run() -> dict[str, httpx.Response]:
        cfg = RouterConfig(prefill=("http://p:1",), decode=("http://d:2", "http://d:3"), health_timeout=2.0)
        api = WorkerAPI(cfg, httpx.MockTransport(fake_worker))
        table = WorkerTable(cfg.prefill, cfg.decode, MonotonicClock())
        monitor = WorkerMonitor(table, api, cfg)
        await monitor.check_all()
        rc = RouterClient(cfg, table, api, monitor, None, "m", 64, table.clock)
        gate = api_gate(SecurityConfig(api_key=("front",), protect_metrics=protect), {})
        transport = httpx.ASGITransport(router_app(rc, gate))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://kvrelay") as c:
                return {p: await c.get(p) for p in ("/metrics", "/metrics/workers", "/workers")}
        finally:
            await rc.close()
            await api.close()

    got = asyncio.run(run())
    if protect:   # everything behind the API key
        assert {p: r.status_code for p, r in got.items()} == {"/metrics": 401, "/metrics/workers": 401,
                                                              "/workers": 401}
        return
    assert (got["/metrics"].status_code, got["/metrics/workers"].status_code, got["/workers"].status_code) == \
        (200, 200, 401)
    text = got["/metrics/workers"].text
    assert_promtool_clean(text)
    assert total(text, "kvrelay_kv_pages_free", worker="http://p:1", role="prefill", model_name="m") == 7
    assert {(s.labels["worker"], s.labels["role"], s.value) for f in _parse(text) for s in f.samples
            if s.name == "kvrelay_worker_scrape_ok"} == {("http://p:1", "prefill", 1.0), ("http://d:2", "decode", 0.0),
                                                          ("http://d:3", "decode", 0.0)}
    own = got["/metrics"].text
    assert {(s.labels["worker"], s.labels["role"]) for f in _parse(own) for s in f.samples
            if s.name == "kvrelay_worker_up" and s.value == 1} == {(u, r) for u, (r, _) in FAKE.items()}
    assert "kvrelay_kv_pages" not in own   # the router has no pool to report


# ---------------------------------------------------------------- a cluster and a Prometheus

REQUESTS = [("Prometheus scrapes the router", 12), ("and the router asks its workers", 9),
            ("a third prompt, a little longer than the others are", 16)]


class Prometheus:
    def __init__(self, router: str, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = yaml.safe_load(SCRAPE_CONFIG.read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(ALERTS)]
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": [router.removeprefix("http://")]}]
            job["scrape_timeout"] = "1s"
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [prometheus_tool("prometheus"), f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready:\n{self.log.read_text()}")

    def query(self, expr: str) -> dict:
        """The instant query's body; status "success" or an AssertionError naming the error."""
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def deployment(tiny_llama_dir):
    """The cluster and a Prometheus scraping it, after traffic: a few completions (their
    usage and every process's metrics right after them are kept), a stream its client
    leaves early, and a request refused with a 400."""
    cluster = Cluster(["--model", f"random:{tiny_llama_dir}"], ["--dtype", "float32", "--max-kv-tokens", "4096"],
                      num_prefill=1, num_decode=1)
    workdir = Path(tempfile.mkdtemp(prefix="kvrelay-prometheus-"))
    prom = Prometheus(cluster.url, workdir)   # it waits for the router's port by itself
    try:
        cluster.start()
        usages = [completion(cluster.url, prompt, n) for prompt, n in REQUESTS]
        after_ok = {p.name: httpx.get(f"{p.url}/metrics", timeout=10).text for p in [cluster.router, *cluster.workers]}
        leave_stream_early(cluster.url)
        bad = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
        assert bad.status_code == 400, bad.text
        prom.wait_ready()
        yield {"cluster": cluster, "prometheus": prom, "usages": usages, "after_ok": after_ok}
        cluster.assert_no_leak()
    finally:
        prom.stop()
        for p in [cluster.router, *cluster.workers]:   # side by side, then wait for each
            if p.popen is not None and p.popen.poll() is None:
                p.signal(signal.SIGTERM)
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def completion(url: str, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def leave_stream_early(url: str) -> None:
    body = {"prompt": "a stream its client leaves", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break   # leaving closes the stream: the router aborts both legs


def total(text: str, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(s.value for f in _parse(text) for s in f.samples if s.name == name and want <= set(s.labels.items()))


def test_counters_mean_what_they_say(deployment):
    after, usages = deployment["after_ok"], deployment["usages"]
    router, prefill, decode = after["router"], after["prefill-0"], after["decode-0"]
    n = len(usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    # Each engine counts what it computed: P every prompt and each first token, D the rest.
    assert total(prefill, "vllm:prompt_tokens_total") == total(prefill, "kvrelay_prompt_tokens_total") == prompt
    assert total(decode, "vllm:prompt_tokens_total") == 0
    assert total(prefill, "vllm:generation_tokens_total") == n
    assert total(prefill, "vllm:generation_tokens_total") + total(decode, "vllm:generation_tokens_total") == generated
    # The front door counts requests and their client-side timings, once each.
    assert total(router, "kvrelay_requests_finished_total", outcome="success") == n
    assert total(router, "vllm:request_success_total", finished_reason="length") == n
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count", "kvrelay_time_to_first_token_seconds_count"):
        assert total(router, name) == n, name
    assert total(router, "vllm:inter_token_latency_seconds_count") == generated - n
    assert total(prefill, "vllm:request_queue_time_seconds_count") == n
    for worker in (prefill, decode):
        assert total(worker, "kvrelay_leg_first_token_seconds_count") == n
    # Each vllm: series lives at one level, so that a sum over every target counts a request once.
    router_only = {"vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_success"}
    engines_only = {"vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:prompt_tokens",
                    "kvrelay_kv_pages_free", "kvrelay_kv_pages_capacity"}
    assert router_only <= families(router) and not engines_only & families(router)
    for worker in (prefill, decode):
        assert engines_only <= families(worker) and not router_only & families(worker)
        assert "kvrelay_time_to_first_token_seconds" not in families(worker)   # the router's name only
    assert 'model_name="' + json.loads(httpx.get(f"{deployment['cluster'].url}/v1/models").text)["data"][0]["id"] \
        in router


def test_promtool_checks_every_roles_metrics(deployment):
    cluster = deployment["cluster"]
    for url in [cluster.router.url, *(p.url for p in cluster.workers), f"{cluster.router.url}/metrics/workers"]:
        text = httpx.get(url if url.endswith("/workers") else f"{url}/metrics", timeout=30).text
        assert_promtool_clean(text)


def test_router_reexports_its_workers(deployment):
    cluster = deployment["cluster"]
    text = httpx.get(f"{cluster.url}/metrics/workers", timeout=30).text
    for proc, role in ((cluster.prefill[0], "prefill"), (cluster.decode[0], "decode")):
        assert total(text, "kvrelay_worker_scrape_ok", worker=proc.url, role=role) == 1
        assert total(text, "kvrelay_kv_pages_capacity", worker=proc.url, role=role) > 0
        assert total(text, "process_cpu_seconds_total", worker=proc.url, role=role) > 0
        direct = metric_samples(proc.url)
        assert sum(gauge(direct, "kvrelay_kv_pages_capacity")) == total(text, "kvrelay_kv_pages_capacity",
                                                                         worker=proc.url)
    own = metric_samples(cluster.url)
    assert {dict(ls)["worker"]: v for (n, ls), v in own.items() if n == "kvrelay_worker_up"} == \
        {p.url: 1.0 for p in cluster.workers}


def test_every_dashboard_and_alert_expression_returns_data(deployment):
    prom: Prometheus = deployment["prometheus"]
    model = json.loads(httpx.get(f"{deployment['cluster'].url}/v1/models").text)["data"][0]["id"]
    # A vLLM dashboard's queries (exact model_name match, as vLLM's own dashboard does).
    vllm = [f'histogram_quantile(0.99, sum by (le) (rate({h}_bucket{{model_name="{model}"}}[1m])))'
            for h in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                      "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:request_queue_time_seconds")]
    vllm += [f'rate({c}{{model_name="{model}"}}[1m])' for c in
             ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total")]
    vllm += [f'{g}{{model_name="{model}"}}' for g in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                     "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")]
    vllm.append(f'sum by (finished_reason) (increase(vllm:request_success_total{{model_name="{model}"}}[1m]))')
    rules = alert_rules()
    wanted = {f"panel {t!r}: {e}": with_variables(e) for t, e in dashboard_queries()}
    wanted.update({f"alert {r['alert']} signal": THRESHOLD.fullmatch(r["expr"])["signal"] for r in rules})
    wanted.update({f"vLLM: {e}": e for e in vllm})
    deadline = time.monotonic() + 30
    while True:   # until every series has been scraped twice after the traffic (rate() needs two samples)
        empty = [k for k, e in wanted.items() if not prom.query(e)["result"]]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert empty == []
    for rule in rules:   # the alert itself evaluates (it is empty on this healthy cluster)
        assert prom.query(rule["expr"])["result"] == [], rule["alert"]
    deadline = time.monotonic() + 10
    while True:
        loaded = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"][0]["rules"]
        evaluated = [r for r in loaded if r["lastEvaluation"] > "0001-01-01T00:00:00Z"]
        if len(evaluated) == len(rules) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [(r["name"], r["health"], r.get("lastError", "")) for r in loaded] == \
        [(r["alert"], "ok", "") for r in rules]


def test_a_pass_that_computes_prompt_tokens_counts_as_prefill_with_its_decodes():
    from kvrelay.obs.metrics import PassStats

    p = PassStats()
    p.add(3, 100, 0.5)    # a prompt's chunk with three decodes beside it
    p.add(4, 0, 0.125)    # decodes only
    p.add(0, 0, 0.25)     # nothing computed: not a pass
    assert (p.prefill_passes, p.prefill_tokens, p.prefill_seconds) == (1, 100, 0.5)
    assert (p.decode_steps, p.decode_sequences, p.decode_seconds) == (1, 4, 0.125)

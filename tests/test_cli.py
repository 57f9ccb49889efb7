"""Start-up errors end the process with one line that says what to fix."""
import subprocess
import sys

import pytest

CASES = [
    (["--page-size", "0"], "--page-size must be at least 1"),
    (["--max-running-requests", "0"], "--max-running-requests must be at least 1"),
    (["--model", "/nonexistent/model-dir"], "does not exist"),
    (["--dtype", "float64"], "invalid choice"),
]


@pytest.mark.parametrize("args,words", CASES)
def test_bad_startup_flags_fail_with_one_clear_line(args, words):
    proc = subprocess.run([sys.executable, "-m", "kvrelay", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert words in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_lists_flags_from_the_config():
    out = subprocess.run([sys.executable, "-m", "kvrelay", "serve", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    for flag in ("--model", "--dtype", "--page-size", "--max-kv-tokens", "--kv-cache-gb",
                 "--max-prefill-tokens", "--max-running-requests", "--host", "--port"):
        assert flag in out


# ---------------------------------------------------------------- the disaggregated commands

import dataclasses
import signal
import textwrap
import time

import httpx

from kvrelay.cli import build_parser, config_from_args
from kvrelay.core.config import KVRelayConfig, LifecycleConfig, ModelOptions, SchedulerConfig, TransferConfig
from serving_helpers import free_port


def parse(*argv: str) -> KVRelayConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay", *argv], capture_output=True, text=True, timeout=timeout)


def test_router_flags_parse_into_the_router_config():
    config = parse("router", "--prefill", "http://a:1", "http://b:2", "--decode", "http://c:3",
                   "--request-timeout", "30", "--max-queued-requests", "8", "--startup-timeout", "5")
    assert config.router.prefill == ("http://a:1", "http://b:2")
    assert config.router.decode == ("http://c:3",)
    assert (config.router.request_timeout, config.router.max_queued_requests) == (30.0, 8)
    assert config.cluster.startup_timeout == 5.0


def test_serve_is_disaggregated_by_default_and_takes_no_worker_urls():
    args = build_parser().parse_args(["serve", "--num-decode", "2", "--request-timeout", "9"])
    assert args.mode == "disagg"
    config = config_from_args(args)
    assert (config.cluster.num_decode, config.router.request_timeout) == (2, 9.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefill", "http://a:1"])


def test_worker_flags_round_trip_through_the_flags_a_cluster_forwards():
    from kvrelay.server.cluster import WORKER_SECTIONS, worker_argv

    config = dataclasses.replace(
        KVRelayConfig(), model=ModelOptions(model="random:/x", seed=3, served_model_name="tiny"),
        scheduler=SchedulerConfig(max_model_len=300), lifecycle=LifecycleConfig(heartbeat_interval=0.25),
        transfer=TransferConfig(transfer_backend="tcp", fault_spec="drop_ack=1.0"))
    argv = worker_argv(config, "decode", 4321)
    assert argv[:4] == [sys.executable, "-m", "kvrelay", "decode"]
    again = parse(*argv[3:])
    for section in WORKER_SECTIONS:
        assert getattr(again, section) == getattr(config, section)
    assert (again.server.host, again.server.port) == ("127.0.0.1", 4321)


@pytest.mark.parametrize("args,words", [
    (["router", "--decode", "http://127.0.0.1:1"], "router needs at least one --prefill URL"),
    (["router", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"], "must start with http://"),
    (["router", "--prefill", "http://a:1", "--decode", "http://a:1"], "listed twice"),
    (["serve", "--num-prefill", "0"], "--num-prefill must be at least 1"),
    (["serve", "--mode", "both"], "invalid choice"),
])
def test_bad_disaggregated_flags_fail_with_one_clear_line(args, words):
    proc = run_cli(*args)
    assert proc.returncode != 0
    assert words in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_router_without_reachable_workers_gives_up_after_the_startup_timeout():
    port = free_port()
    proc = run_cli("router", "--prefill", f"http://127.0.0.1:{port}", "--decode", f"http://127.0.0.1:{port + 1}",
                   "--startup-timeout", "1", "--port", str(free_port()))
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvrelay: error: no healthy prefill worker after 1 s") and f":{port}" in last, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["serve", "router", "prefill", "decode"])
def test_every_command_has_help(command):
    out = run_cli(command, "--help", timeout=60).stdout
    assert "--port" in out and "--model" in out
    for flag in {"serve": ("--mode", "--num-prefill", "--transfer-backend", "--request-timeout"),
                 "router": ("--prefill", "--decode", "--health-interval", "--max-queued-requests"),
                 "prefill": ("--transfer-backend", "--heartbeat-interval"),
                 "decode": ("--waiting-timeout", "--fault-spec")}[command]:
        assert flag in out


# ---------------------------------------------------------------- the local cluster, with stand-in workers

# A stand-in worker (stdlib only) that speaks the worker protocol: health, a prefill leg of
# one line, a decode leg of `max_tokens` tokens " t0 t1 ...". FAKE_FAIL=<role> makes that
# role exit at startup the way a real worker reports a bad flag.
FAKE_WORKER = textwrap.dedent('''
    import http.server, json, os, sys
    role, port = sys.argv[1], int(sys.argv[sys.argv.index("--port") + 1])
    if os.environ.get("FAKE_FAIL") == role:
        print("loading the model", flush=True)
        print("kvrelay: error: model path '/nope' does not exist", flush=True)
        sys.exit(3)

    def line(rid, ids, text, finish):
        return (json.dumps({"rid": rid, "token_ids": ids, "text": text, "logprobs": [], "prompt_tokens": 0,
                            "completion_tokens": 0, "finish_reason": finish, "error": None}) + "\\n").encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, body, kind="application/json"):
            self.send_response(200)
            self.send_header("content-type", kind)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply(json.dumps({"role": role, "worker_id": role, "incarnation": str(os.getpid()), "model": "fake",
                                   "max_model_len": 512, "transfer_backend": "fake", "transfer_address": "tcp://x:1",
                                   "live_requests": 0, "queued_requests": 0, "free_pages": 1, "total_pages": 1,
                                   "omp": os.environ.get("OMP_NUM_THREADS")}).encode())

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if self.path == "/abort":
                return self.reply(b'{"aborted": false}')
            n = body["sampling"]["max_tokens"]
            if role == "prefill":
                return self.reply(line(body["rid"], [1], "", "length"), "application/x-ndjson")
            self.reply(b"".join(line(body["rid"], [i + 1], f" t{i}", "length" if i == n - 1 else None)
                                for i in range(n)), "application/x-ndjson")

        def log_message(self, *args):
            pass

    print(f"fake {role} ready pid={os.getpid()}", flush=True)
    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


@pytest.fixture
def fake_worker(tmp_path, monkeypatch):
    import kvrelay.server.cluster as cluster

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(cluster, "worker_argv",
                        lambda config, role, port: [sys.executable, str(script), role, "--port", str(port)])
    return script


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] in "ZX"   # a zombie has exited
    except FileNotFoundError:
        return True


def test_the_local_cluster_starts_its_workers_waits_for_them_and_stops_them(fake_worker, capsys):
    from kvrelay.server.cluster import LocalCluster

    config = dataclasses.replace(KVRelayConfig(), cluster=dataclasses.replace(
        KVRelayConfig().cluster, num_prefill=1, num_decode=2, worker_threads=3, startup_timeout=60))
    cluster = LocalCluster(config)
    try:
        cluster.start()
        cluster.wait_ready()
        assert len(cluster.urls("prefill")) == 1 and len(set(cluster.urls("decode"))) == 2
        health = httpx.get(f"{cluster.urls('decode')[1]}/health").json()
        assert (health["role"], health["omp"]) == ("decode", "3")
    finally:
        cluster.stop()
    assert all(w.proc.returncode is not None for w in cluster.workers)
    err = capsys.readouterr().err
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert f"[{name}] fake {name.split('-')[0]} ready" in err


def test_a_worker_that_exits_at_startup_stops_the_cluster_with_its_error(fake_worker, monkeypatch):
    from kvrelay.server.cluster import LocalCluster
    from kvrelay.server.errors import StartupError

    monkeypatch.setenv("FAKE_FAIL", "decode")
    cluster = LocalCluster(KVRelayConfig())
    try:
        cluster.start()
        with pytest.raises(StartupError) as err:
            cluster.wait_ready()
    finally:
        cluster.stop()
    assert str(err.value) == "decode worker 0 exited with code 3: model path '/nope' does not exist"
    assert all(w.proc.returncode is not None for w in cluster.workers)


def test_a_worker_dies_with_its_parent(tmp_path):
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent('''
        import os, subprocess, sys
        from kvrelay.server.cluster import _die_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 start_new_session=True, preexec_fn=_die_with_parent())
        print(child.pid, flush=True)
        os._exit(0)
    '''))
    pid = int(subprocess.run([sys.executable, str(parent)], capture_output=True, text=True, timeout=60).stdout)
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pid)


SERVE_WITH_FAKE_WORKERS = textwrap.dedent('''
    import sys
    import kvrelay.server.cluster as cluster
    cluster.worker_argv = lambda config, role, port: [sys.executable, sys.argv[1], role, "--port", str(port)]
    from kvrelay.cli import main
    main(sys.argv[2:])
''')


def test_serve_runs_the_router_before_its_workers_and_sigterm_leaves_no_process_behind(fake_worker, tmp_path):
    launcher = tmp_path / "serve.py"
    launcher.write_text(SERVE_WITH_FAKE_WORKERS)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(launcher), str(fake_worker), "serve", "--port", str(port),
                             "--num-decode", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        assert banner.startswith("kvrelay serve: model fake, 1 prefill + 2 decode workers (transfer shm), "
                                 f"serving on http://127.0.0.1:{port}"), banner + proc.stderr.read()
        url = f"http://127.0.0.1:{port}"
        for _ in range(2):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == " t0 t1 t2"
        workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
        assert sorted(w["role"] for w in workers if w["up"]) == ["decode", "decode", "prefill"]
        pids = [int(w["health"]["incarnation"]) for w in workers]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "outcome=success reason=length" in err
    assert all(gone(pid) for pid in pids)

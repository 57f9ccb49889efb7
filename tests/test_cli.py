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

import contextlib
import dataclasses
import os
import re
import signal
import time
from pathlib import Path

import httpx
import torch

from kvrelay.cli import build_parser, config_from_args
from kvrelay.core.config import KVRelayConfig, LifecycleConfig, ModelOptions, SchedulerConfig, TransferConfig
from kvrelay.engine import attention, kernels
from kvrelay.engine.core_share import host_cores
from serving_helpers import assert_no_leak, free_port, free_port_run, gauge, metric_samples


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


def test_the_transfer_backend_choices_are_the_registry(capsys):
    """One `register_lazy` line adds a backend to the CLI: every registered name parses, and
    any other is refused naming the registry's choices."""
    from kvrelay.disagg.transfer import TRANSFER_BACKENDS
    names = TRANSFER_BACKENDS.names()
    assert {"shm", "tcp", "nixl"} <= set(names)
    for name in names:
        assert parse("prefill", "--transfer-backend", name).transfer.transfer_backend == name
    with pytest.raises(SystemExit):
        parse("prefill", "--transfer-backend", "carrier-pigeon")
    assert f"choose from {', '.join(map(repr, names))}" in capsys.readouterr().err


def test_serve_is_disaggregated_by_default_and_takes_no_worker_urls():
    args = build_parser().parse_args(["serve", "--num-decode", "2", "--request-timeout", "9"])
    assert args.mode == "disagg"
    config = config_from_args(args)
    assert (config.cluster.num_decode, config.router.request_timeout) == (2, 9.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefill", "http://a:1"])


def test_serve_gives_its_shed_ttft_to_the_router_and_none_to_its_workers():
    from kvrelay.server.cluster import shedding_at_the_router, worker_argv

    assert parse("router", "--prefill", "http://a:1", "--decode", "http://b:2", "--shed-ttft", "1.5").router.shed_ttft == 1.5
    config = shedding_at_the_router(parse("serve", "--shed-ttft", "2"))
    assert (config.router.shed_ttft, config.scheduler.shed_ttft) == (2.0, 0.0)
    assert "--shed-ttft" not in worker_argv(config, "prefill", 4321)
    split = parse("serve", "--decode-prefill-ttft", "1.5")
    assert split.router.decode_prefill_ttft == 1.5
    assert "--decode-prefill-ttft" not in worker_argv(split, "decode", 4321)


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
    fixed = dataclasses.replace(config, transfer=TransferConfig(transfer_port=7000))
    ports = [parse(*worker_argv(fixed, "decode", 1, i)[3:]).transfer.transfer_port for i in range(3)]
    assert ports == [7000, 7001, 7002]  # one fixed port per local worker, no clash
    from kvrelay.server.cluster import worker_threads
    cl = parse("serve").cluster
    assert worker_threads(cl, 2) == (2, True) and worker_threads(cl, 16) == (16, True)   # 1P+1D
    more = parse("serve", "--num-prefill", "2", "--num-decode", "2").cluster
    assert worker_threads(more, 2) == (1, False) and worker_threads(more, 8) == (8, True)   # more workers than cores
    assert worker_threads(parse("serve", "--worker-threads", "3").cluster, 2) == (3, False)
    assert worker_threads(parse("serve", "--no-share-cores").cluster, 8) == (4, False)
    shares = [parse(*worker_argv(config, "decode", 1, i, "/dev/shm/f")[3:]).scheduler.core_share for i in range(3)]
    assert shares == ["/dev/shm/f:0", "/dev/shm/f:1", "/dev/shm/f:2"]   # one slot per local worker
    assert parse(*argv[3:]).scheduler.core_share is None


@pytest.mark.parametrize("args,words", [
    (["prefill", "--core-share", "/tmp/x"], "--core-share must be FILE:SLOT with SLOT from 0 to 63"),
    (["decode", "--core-share", "/tmp/x:64"], "--core-share must be FILE:SLOT with SLOT from 0 to 63"),
    (["serve", "--core-share", "/tmp/x:0"], "unrecognized arguments: --core-share"),   # serve gives each worker one
    (["router", "--prefill", "http://a:1", "--decode", "http://a:2", "--no-share-cores"],
     "unrecognized arguments: --no-share-cores"),
])
def test_a_bad_core_share_fails_with_one_clear_line(args, words):
    proc = run_cli(*args)
    assert proc.returncode != 0
    assert words in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.parametrize("args,words", [
    (["router", "--decode", "http://127.0.0.1:1"], "router needs at least one --prefill URL"),
    (["router", "--port", "0", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
     "must start with http://"),
    (["router", "--port", "0", "--prefill", "http://a:1", "--decode", "http://a:1"], "listed twice"),
    (["serve", "--num-prefill", "0"], "--num-prefill must be at least 1"),
    (["prefill", "--fault-spec", "drop_ack=1"], "needs --enable-fault-injection"),
    (["decode", "--enable-fault-injection", "--host", "0.0.0.0"], "needs --host and --transfer-host on loopback"),
    (["decode", "--enable-fault-injection", "--transfer-host", "10.0.0.5"], "on loopback"),
    (["serve", "--mode", "both"], "invalid choice"),
    (["prefill", "--port", "0", "--shed-ttft", "2"], "give it to the router"),
    (["decode", "--port", "0", "--shed-ttft", "2"], "give it to the router"),
    (["router", "--port", "0", "--prefill", "http://a:1", "--decode", "http://a:2", "--shed-ttft", "-1"],
     "--shed-ttft must be 0 (off) or a positive"),
    (["serve", "--queue-order", "shortest-first", "--max-queue-wait", "0"], "--max-queue-wait must be a positive"),
    (["serve", "--mode", "colocated", "--port", "0", "--decode-prefill-ttft", "1"],
     "--decode-prefill-ttft: only for disaggregated serving; --mode colocated has no router, workers or KV "
     "transfer (drop it"),
    (["serve", "--mode", "colocated", "--port", "0", "--num-decode", "2", "--no-share-cores",
      "--transfer-backend", "tcp", "--heartbeat-interval", "2"],
     "--heartbeat-interval, --transfer-backend, --num-decode, --no-share-cores: only for disaggregated serving"),
    (["serve", "--mode", "colocated", "--port", "0", "--cluster-key-file", "k", "--ssl-ca-certs", "ca.pem",
      "--replay-window", "5", "--api-key", "sk-1"],
     "--cluster-key-file, --ssl-ca-certs, --replay-window: only for disaggregated serving"),
    (["router", "--port", "0", "--prefill", "http://a:1", "--decode", "http://a:2", "--decode-prefill-ttft", "-1"],
     "--decode-prefill-ttft must be 0 (off) or a positive"),
])
def test_bad_disaggregated_flags_fail_with_one_clear_line(args, words):
    proc = run_cli(*args)
    assert proc.returncode != 0
    assert words in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_fault_spec_from_the_environment_also_needs_the_flag():
    proc = subprocess.run([sys.executable, "-m", "kvrelay", "prefill"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, KVRELAY_FAULTS="drop_ack=1"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "kvrelay: error: a fault spec (--fault-spec or KVRELAY_FAULTS) needs --enable-fault-injection"), proc.stderr


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


# ---------------------------------------------------------------- `kvrelay serve`: the local cluster, real workers

def children(pid: int) -> list[int]:
    """The processes (zombies aside) whose parent is `pid`, from /proc/*/stat."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] not in "ZX":
            kids.append(int(stat.parent.name))
    return sorted(kids)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"   # a zombie has exited
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(not gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if not gone(p)]


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


class Serve:
    """`python -m kvrelay serve` (real workers) on the tiny model, in its own process group
    as a shell runs a job; stdout and stderr go to files. Its workers take the next ports."""

    def __init__(self, tmp_path: Path, model_dir, *flags: str,
                 kv: tuple[str, ...] = ("--max-kv-tokens", "4096"),
                 threads: tuple[str, ...] = ("--worker-threads", "1")) -> None:
        self.port = free_port_run(3)
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.err = tmp_path / "serve.out", tmp_path / "serve.err"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvrelay", "serve", "--model", f"random:{model_dir}", "--dtype", "float32",
                 *kv, *threads, "--transfer-backend", "shm", "--port", str(self.port), *flags],
                stdout=out, stderr=err, env=env, start_new_session=True)
        self.seen: set[int] = set()   # every child seen so far

    def watch(self) -> list[int]:
        kids = children(self.proc.pid)
        self.seen.update(kids)
        return kids

    def banner(self, timeout: float = 180.0) -> str:
        """The first line on stdout, once serve prints it (it does when it is ready)."""
        deadline = time.monotonic() + timeout
        while not self.out.read_text():
            self.watch()
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no banner after {timeout} s:\n{self.stderr()}"
            time.sleep(0.1)
        return self.out.read_text().splitlines()[0]

    def wait(self, timeout: float = 180.0) -> int:
        """Its exit code, noting its children until then."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.watch()
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"serve still running after {timeout} s:\n{self.stderr()}")
            time.sleep(0.05)
        return self.proc.returncode

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def kill(self) -> None:
        """Cleanup after a failed test: serve, then whatever children it left (SIGTERM
        first, so that they remove their shared-memory segments)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc.kill()
        self.proc.wait()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = [p for p in self.seen if not gone(p) and "kvrelay" in cmdline(p)]
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            wait_gone(left, 15)


@pytest.fixture
def serve(tmp_path, tiny_llama_dir):
    started = []

    def start(*flags: str, **kw) -> Serve:
        started.append(Serve(tmp_path, tiny_llama_dir, *flags, **kw))
        return started[-1]
    yield start
    for s in started:
        if s.proc.poll() is None or any(not gone(p) for p in s.seen):
            s.kill()


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_serve_starts_its_workers_serves_and_a_signal_stops_every_child(serve, stop):
    """`kvrelay serve` starts a prefill and a decode worker (their own sessions; by default
    sharing the host's cores through one file, a slot each; with --worker-threads, on that
    many threads each), waits for them, prints one line with its URL, serves; SIGTERM, or a
    terminal's Ctrl-C (SIGINT to serve's process group, which the workers are not in), stops
    serve with exit code 0 and every worker with it, and removes the share file."""
    shared = stop == "SIGTERM"   # one run each way
    s = serve(threads=() if shared else ("--worker-threads", "1"))
    banner = s.banner()
    kids = s.watch()
    model = httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"][0]["id"]
    assert banner == (f"kvrelay serve: model {model}, 1 prefill + 1 decode workers (transfer shm), "
                      f"serving on {s.url}")
    assert sorted(cmdline(pid)[3] for pid in kids) == ["decode", "prefill"], [cmdline(p) for p in kids]
    for pid in kids:
        assert os.getsid(pid) == pid and os.getpgid(pid) != os.getpgid(s.proc.pid)
        # shared: each may use every core and takes its part before a step
        assert environ(pid)["OMP_NUM_THREADS"] == (str(host_cores()) if shared else "1")
    shares = sorted(cmdline(p)[cmdline(p).index("--core-share") + 1].rpartition(":")[::2] for p in kids
                    if "--core-share" in cmdline(p))
    if shared:
        assert len({f for f, _ in shares}) == 1 and [slot for _, slot in shares] == ["0", "1"], shares
        share_file = Path(shares[0][0])
        assert share_file.exists()
    else:
        assert shares == []
    workers = httpx.get(f"{s.url}/workers", timeout=10).json()["workers"]
    assert sorted((w["role"], w["up"]) for w in workers) == [("decode", True), ("prefill", True)]
    urls = [w["url"] for w in workers]
    for w in workers:   # the router's workers are those children
        argv = next(cmdline(p) for p in kids if cmdline(p)[3] == w["role"])
        assert w["url"] == f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    # fixed ports: prefill worker 0 on --port + 1, decode worker 0 after it
    assert {w["role"]: w["url"] for w in workers} == {"prefill": f"http://127.0.0.1:{s.port + 1}",
                                                      "decode": f"http://127.0.0.1:{s.port + 2}"}

    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0,
                                                    "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
    assert_no_leak(s.url)   # the router and both workers
    for url in urls:   # idle and shared, each engine may use every core (once both have stepped idle)
        want, deadline = [host_cores() if shared else 1], time.monotonic() + 30
        while gauge(metric_samples(url), "kvrelay_engine_threads") != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gauge(metric_samples(url), "kvrelay_engine_threads") == want

    if stop == "SIGTERM":
        s.proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(s.proc.pid, signal.SIGINT)
    assert s.wait(timeout=60) == 0, s.stderr()
    assert wait_gone(kids, 0) == []   # serve waited for them before it exited
    assert not any(answers(u) for u in urls)
    assert not shared or not share_file.exists()
    assert s.out.read_text().splitlines() == [banner]
    err = s.stderr()
    assert "Traceback" not in err, err
    for role in ("prefill", "decode"):
        line = re.search(rf"\[{role}-0\] kvrelay {role}: model {model} \((.*?)\), KV capacity 4096 tokens", err)
        assert line is not None and line[1] == (f"float32, kernels {kernels.isa()}, weights same, KV cache float32, "
                                                f"attention {attention.resolve('auto', 'cpu', torch.float32)}"), err
    assert "outcome=success reason=length" in err
    # progress while it starts, in order: the workers and their ports, each worker ready
    progress = [ln.split(" INFO kvrelay.serve ", 1)[1] for ln in err.splitlines() if " INFO kvrelay.serve " in ln]
    assert progress[0].startswith("starting workers model=random:") and \
        progress[0].endswith(f"workers=prefill-0@{s.port + 1},decode-0@{s.port + 2} transfer=shm"), progress
    assert sorted(ln.split()[2] for ln in progress[1:] if ln.startswith("worker ready")) == \
        ["worker=decode-0", "worker=prefill-0"], progress
    # uvicorn's lines in kvrelay's format (timestamp, level, logger), from serve and its workers alike
    assert any(ln.endswith("INFO uvicorn.error Application startup complete.") and ln[:4].isdigit()
               for ln in err.splitlines()), err
    assert any(ln.startswith("[prefill-0] ") and ln.endswith(" INFO uvicorn.error Application startup complete.")
               for ln in err.splitlines()), err


def test_a_worker_that_fails_at_startup_stops_serve_with_one_line_naming_it(serve):
    """--kv-cache-gb 100000: each worker's shared-memory KV segment cannot be created, so
    the workers exit at startup. serve prints no banner, stops, and its last line names the
    worker it saw exit and that worker's own last words; no child is left."""
    s = serve("--kv-cache-gb", "100000", kv=())
    assert s.wait() == 1
    assert s.out.read_text() == ""
    err = s.stderr()
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(r"kvrelay: error: (prefill|decode) worker 0 exited with code 1: the (?:prefill|decode) worker "
                     r"could not start: RuntimeError: (/dev/shm "
                     r"has \d+ bytes free but the KV pool needs \d+: enlarge it \(docker --shm-size\) or use another "
                     r"--transfer-backend)", last)
    assert m, err
    # That worker's own last line (its output is forwarded with its name in front).
    role, detail = m[1], m[2]
    prefix = f"[{role}-0] "
    assert [ln for ln in err.splitlines() if ln.startswith(prefix) and ln[len(prefix):].strip()][-1].endswith(detail)
    assert len(s.seen) == 2 and wait_gone(sorted(s.seen), 0) == []
    assert "Traceback" not in err  # each worker says it in one line too


def test_the_workers_die_with_serve(serve):
    """kill -9 of serve (no chance to stop anything): the kernel sends each worker SIGTERM
    (PR_SET_PDEATHSIG), so they are gone within seconds and remove their shared-memory KV
    segments."""
    s = serve()
    s.banner()
    kids = s.watch()
    workers = httpx.get(f"{s.url}/workers", timeout=10).json()["workers"]
    segments = [Path(f"/dev/shm/kvrelay_{w['health']['incarnation']}") for w in workers]
    assert len(kids) == 2 and all(seg.exists() for seg in segments)
    assert_no_leak(s.url)
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait()
    assert wait_gone(kids, 15) == [], [cmdline(p) for p in kids if not gone(p)]
    assert not any(answers(w["url"]) for w in workers)
    assert not any(seg.exists() for seg in segments)

"""`kvrelay serve` supervises its workers (issue #53): it reaps a worker that dies, says so
on /health while it is down, restarts it at its port (a new incarnation), and exits 1 with
one line naming it after --max-worker-restarts quick deaths in a row. The pure parts (the
table's health view, the restart policy) under a SimClock; the rest on real processes
(`test_cli.Serve`: the tiny model), each ending with nothing leaked and no child left."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx

from kvrelay.core.clock import SimClock
from kvrelay.server.supervisor import BACKOFF_MAX, STABLE_AFTER, Restarts, exit_text
from kvrelay.server.pairing import WorkerTable
from serving_helpers import assert_no_leak, free_port_run, gauge, metric_samples
from test_cli import cmdline, serve, wait_gone  # noqa: F401 - serve: the fixture

P1, D1, D2 = "http://p1:8000", "http://d1:8000", "http://d2:8000"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def health(role: str, incarnation: str = "a"):
    from kvrelay.server.worker_protocol import WorkerHealth

    return WorkerHealth(role=role, worker_id="w", incarnation=incarnation, model="m", max_model_len=2048,
                        transfer_backend="shm", transfer_address="tcp://127.0.0.1:5000", live_requests=0,
                        queued_requests=0, free_pages=100, total_pages=100)


# ---------------------------------------------------------------- pure: the health view, the restart policy

def test_the_health_view_names_each_down_worker_and_whether_requests_are_served():
    clock = SimClock()
    t = WorkerTable([P1], [D1, D2], clock)
    clock.advance(4.0)
    t.mark_ok(P1, health("prefill"))
    t.mark_ok(D1, health("decode"))
    # D2 never answered: down since the table began
    assert t.health_view() == {"status": "degraded", "down": [
        {"url": D2, "role": "decode", "why": "not checked yet", "since_s": 4.0}]}
    t.mark_ok(D2, health("decode"))
    assert t.health_view() == {"status": "ok"}
    t.mark_slow(D1, "no answer to GET /health within --health-timeout 2 s")   # slow is still up
    assert t.health_view() == {"status": "ok"}
    t.mark_failed(D2, "connection refused")
    clock.advance(2.5)
    assert t.health_view() == {"status": "degraded", "down": [
        {"url": D2, "role": "decode", "why": "connection refused", "since_s": 2.5}]}
    t.mark_failed(D1, "exited (signal SIGKILL)")
    clock.advance(0.5)
    assert t.health_view() == {"status": "unavailable", "down": [   # table order, each its own since
        {"url": D1, "role": "decode", "why": "exited (signal SIGKILL)", "since_s": 0.5},
        {"url": D2, "role": "decode", "why": "connection refused", "since_s": 3.0}]}
    t.mark_ok(D1, health("decode", incarnation="b"))
    assert t.health_view()["status"] == "degraded"
    t.mark_failed(P1, "refused")
    assert [(d["url"], d["role"]) for d in t.health_view()["down"]] == [(P1, "prefill"), (D2, "decode")]
    assert t.health_view()["status"] == "unavailable"


def died(r: Restarts, clock: SimClock, after_ready: float) -> float | None:
    """The running process became ready, ran `after_ready` seconds and died; if a restart
    follows, it is made (after the delay)."""
    r.ready_at = clock.now()
    clock.advance(after_ready)
    delay = r.after_death(clock.now())
    if delay is not None:
        clock.advance(delay)
        r.total += 1
    return delay


def test_restarts_back_off_1_s_doubling_and_give_up_after_the_limit_of_quick_deaths():
    clock, r = SimClock(), Restarts(limit=5)
    # the first process served an hour; then each restart dies within the minute
    assert [died(r, clock, s) for s in (3600, 10, 10, 10, 10, 10)] == [1.0, 2.0, 4.0, 8.0, 16.0, None]
    assert (r.total, r.streak) == (5, 5)   # five restarts in a row, each dead within a minute: give up

    clock, r = SimClock(), Restarts(limit=20)
    delays = [died(r, clock, 1) for _ in range(8)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, BACKOFF_MAX, BACKOFF_MAX, BACKOFF_MAX]


def test_a_restart_that_served_a_minute_starts_a_new_streak_and_one_never_ready_is_quick():
    clock, r = SimClock(), Restarts(limit=1)
    assert died(r, clock, 5) == 1.0            # the first process: not a restart, never counts
    assert died(r, clock, STABLE_AFTER) == 1.0  # the restart served a minute: it recovered
    assert r.streak == 0
    clock.advance(3)
    assert r.after_death(clock.now()) is None   # the next restart died before it was ready
    assert Restarts(limit=0).after_death(0.0) is None   # 0: exit at the first death


def test_exit_text_says_code_or_signal():
    assert [exit_text(c) for c in (0, 1, -signal.SIGKILL, -signal.SIGSEGV)] == \
        ["code 0", "code 1", "signal SIGKILL", "signal SIGSEGV"]


# ---------------------------------------------------------------- real processes

def role_pids(s, role: str) -> list[int]:
    """serve's children running `kvrelay <role>` (not one forked but not yet exec'd)."""
    def runs(pid: int) -> bool:
        try:
            return cmdline(pid)[3:4] == [role]
        except FileNotFoundError:
            return False
    return [p for p in s.watch() if runs(p)]


def workers(s) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(f"{s.url}/workers", timeout=10).json()["workers"]}


def wait_health(s, want, timeout: float = 60.0) -> tuple[int, dict]:
    """Until `want(code, body)` holds for serve's /health; noting its children meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        s.watch()
        r = httpx.get(f"{s.url}/health", timeout=10)
        if want(r.status_code, r.json()):
            return r.status_code, r.json()
        assert time.monotonic() < deadline, f"/health {r.status_code} {r.text}\n{s.stderr()[-3000:]}"
        time.sleep(0.05)


def chat(s) -> httpx.Response:
    return httpx.post(f"{s.url}/v1/chat/completions", json=CHAT, timeout=60)


def restarts(s, url: str) -> list[float]:
    return gauge(metric_samples(s.url), "kvrelay_serve_worker_restarts_total", worker=url)


def down_by_exit(url: str):
    """A /health predicate: `url` is listed down, and serve has reaped it."""
    def check(code: int, body: dict) -> bool:
        return any(d["url"] == url and d["why"].startswith("exited (") for d in body.get("down", ()))
    return check


def test_a_killed_decode_worker_is_reaped_reported_and_restarted(serve):
    """kill -9 of the only decode worker: /health is 503 naming it (name, role, why, since,
    restarts) while it is down, and requests get no_healthy_worker; the dead child is
    reaped; it comes back at its port with the same command line (a new incarnation the
    router logs as restarted), /health is 200 ok again, a chat completion succeeds, the
    restart is counted, and SIGTERM still stops every child."""
    s = serve()
    s.banner()
    assert httpx.get(f"{s.url}/health", timeout=10).json() == {"status": "ok"}
    assert chat(s).status_code == 200
    (old_pid,) = role_pids(s, "decode")
    old_argv = cmdline(old_pid)
    before = workers(s)
    d_url = next(u for u, w in before.items() if w["role"] == "decode")
    p_url = next(u for u, w in before.items() if w["role"] == "prefill")

    os.kill(old_pid, signal.SIGKILL)
    code, body = wait_health(s, down_by_exit(d_url), timeout=15)
    refused = chat(s)   # the restart waits 1 s, then a process loads: it is still down
    assert code == 503 and body["status"] == "unavailable", body
    (entry,) = body["down"]
    assert entry["url"] == d_url and entry["role"] == "decode" and entry["name"] == "decode worker 0"
    assert entry["why"].startswith("exited (signal SIGKILL): ") and 0 <= entry["since_s"] < 15
    assert entry["restarts"] in (0, 1)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_healthy_worker", refused.text
    assert not Path(f"/proc/{old_pid}").exists()   # reaped: not even a zombie

    wait_health(s, lambda c, b: c == 200 and b == {"status": "ok"})
    after = workers(s)
    assert after[d_url]["up"] and after[d_url]["health"]["incarnation"] != before[d_url]["health"]["incarnation"]
    assert after[p_url]["health"]["incarnation"] == before[p_url]["health"]["incarnation"]
    (new_pid,) = role_pids(s, "decode")
    assert new_pid != old_pid and cmdline(new_pid) == old_argv   # same port, flags, core-share slot
    r = chat(s)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert restarts(s, d_url) == [1.0] and restarts(s, p_url) == [0.0]
    assert_no_leak(s.url)

    err = s.stderr()
    exited = [ln for ln in err.splitlines() if " WARNING kvrelay.serve worker exited " in ln]
    assert len(exited) == 1 and 'worker=decode-0 exit="signal SIGKILL"' in exited[0], exited
    assert re.search(rf"WARNING kvrelay.router worker restarted worker={re.escape(d_url)} role=decode", err), err
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(timeout=60) == 0, s.stderr()[-3000:]
    assert wait_gone(sorted(s.seen), 0) == []
    assert "Traceback" not in s.stderr()


def test_two_decode_workers_one_down_is_degraded_and_sigterm_while_down_restarts_nothing(serve):
    """With two decode workers, one killed leaves /health 200 "degraded" naming it while
    requests are served by the other; it comes back. Then a kill followed at once by
    SIGTERM: serve exits 0 promptly without restarting it, leaving no child."""
    s = serve("--num-decode", "2", "--worker-base-port", str(free_port_run(3)))
    s.banner()
    d0, d1 = sorted(u for u, w in workers(s).items() if w["role"] == "decode")
    pids = {cmdline(p)[cmdline(p).index("--port") + 1]: p for p in role_pids(s, "decode")}
    os.kill(pids[d1.rsplit(":", 1)[1]], signal.SIGKILL)
    code, body = wait_health(s, down_by_exit(d1), timeout=15)
    assert code == 200 and body["status"] == "degraded", body
    assert [(d["url"], d["name"]) for d in body["down"]] == [(d1, "decode worker 1")]
    served = [chat(s) for _ in range(3)]   # all on decode worker 0
    assert [r.status_code for r in served] == [200, 200, 200], [r.text for r in served]
    wait_health(s, lambda c, b: c == 200 and b == {"status": "ok"})
    assert restarts(s, d1) == [1.0] and restarts(s, d0) == [0.0]
    assert_no_leak(s.url)

    os.kill(pids[d0.rsplit(":", 1)[1]], signal.SIGKILL)
    s.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert s.wait(timeout=60) == 0, s.stderr()[-3000:]
    assert time.monotonic() - t0 < 20
    assert wait_gone(sorted(s.seen), 0) == []
    assert "worker restarting worker=decode-0" not in s.stderr()
    assert "Traceback" not in s.stderr()


def test_a_worker_that_keeps_dying_stops_serve_with_one_line_naming_it(serve):
    """--max-worker-restarts 1: the decode worker is restarted once; killed again within a
    minute of coming back, serve stops every child and exits 1, its last line naming the
    worker, how it died and its last line."""
    s = serve("--max-worker-restarts", "1")
    s.banner()
    assert chat(s).status_code == 200
    assert_no_leak(s.url)
    (first,) = role_pids(s, "decode")
    os.kill(first, signal.SIGKILL)
    wait_health(s, lambda c, b: c == 200 and b == {"status": "ok"} and role_pids(s, "decode") not in ([], [first]))
    (second,) = role_pids(s, "decode")
    os.kill(second, signal.SIGKILL)
    assert s.wait(timeout=60) == 1, s.stderr()[-3000:]
    err = s.stderr()
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"kvrelay: error: decode worker 0 exited \(signal SIGKILL\) after 1 restart in a row, "
                        r"each dying within 60 s of becoming ready \(--max-worker-restarts 1\): \S.*", last), last
    assert wait_gone(sorted(s.seen), 0) == [] and not Path(f"/proc/{second}").exists()
    assert "Traceback" not in err


def test_max_worker_restarts_0_exits_at_the_first_death(serve):
    """--max-worker-restarts 0: the first worker that dies (here the prefill worker) stops
    serve with exit code 1 and one line naming it; the decode worker is stopped too."""
    s = serve("--max-worker-restarts", "0")
    s.banner()
    assert chat(s).status_code == 200
    assert_no_leak(s.url)
    (prefill,) = role_pids(s, "prefill")
    os.kill(prefill, signal.SIGKILL)
    assert s.wait(timeout=60) == 1, s.stderr()[-3000:]
    last = s.stderr().strip().splitlines()[-1]
    assert re.fullmatch(r"kvrelay: error: prefill worker 0 exited \(signal SIGKILL\) and --max-worker-restarts "
                        r"is 0: \S.*", last), last
    assert wait_gone(sorted(s.seen), 0) == []
    assert "worker restarting" not in s.stderr() and "Traceback" not in s.stderr()

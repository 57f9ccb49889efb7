"""The router (kvrelay/server/router.py) in front of real `kvrelay prefill` / `kvrelay
decode` processes on a tiny random model: streaming, the one retry on another pair, a
worker's 400, a client abort and the end-to-end deadline, admission (503), no healthy pair,
health checks that keep out a worker of another role or model until it is fixed, a worker
that goes away between checks, the refusal to start over workers of different models, and
the aggregated debug view. Faults are switched on at run time through each worker's
POST /debug/faults.

The module starts its processes at once and shares them: two prefill workers, one decode
worker, a `kvrelay router` process over them (--max-queued-requests 2), and one more
prefill worker that no decode worker can bootstrap with. The abort/deadline and health-check
tests build a RouterClient in this process, the way `run_router` does, to choose its flags
and drive its checks; everything else goes through the router process's HTTP API. Every
test leaves the workers healthy and ends with a no-leak check. (Kill -9, SIGSTOP of a
prefill worker, stuck transfers, mid-stream disconnects and the per-worker debug rows are
in test_cluster.py.)"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cluster_helpers import LIFECYCLE_FLAGS, Cluster, Proc, phase_gauges, router_client
from kvrelay.engine.types import FinishReason, GenerateRequest, SamplingParams
from kvrelay.server.errors import OpenAIError
from kvrelay.server.router import RouterClient
from serving_helpers import free_port, gauge, metric_samples

MAX_QUEUED = 2
# How the legs of a try whose KV write failed on P end on the workers. P sends D a Notice as
# the write fails, and records the failure in the room's lifecycle at its next poll; the
# router's abort (sent when D's failure reaches it) or D's heartbeat echoing the failure
# can come first.
P_FAILED_TRY = {("failed", "transfer_error"), ("aborted", "aborted"), ("failed", "peer_failed")}
D_FAILED_TRY = {("failed", "transfer_error"), ("aborted", "aborted")}   # P's Notice keeps the reason


@dataclass
class Deployment:
    cluster: Cluster     # prefill-0, prefill-1, decode-0; its router has --max-queued-requests 2
    unreachable: Proc    # a prefill worker that drops its BootstrapInfo messages (from birth)


def stop_all(procs: list[Proc]) -> None:
    """SIGTERM all first, so that they shut down side by side, then wait for each."""
    for p in procs:
        if p.popen is not None and p.popen.poll() is None:
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def deployment(tiny_llama_dir):
    c = Cluster(["--model", f"random:{tiny_llama_dir}"], ["--dtype", "float32", "--max-kv-tokens", "16384"],
                num_prefill=2, num_decode=1)
    c.router.argv += ["--max-queued-requests", str(MAX_QUEUED)]   # argparse: the last value wins
    unreachable = worker_proc(c, "prefill-unreachable", "prefill", tiny_llama_dir, free_port(),
                              "--fault-spec", "drop:BootstrapInfo=1")
    procs = [*c.workers, unreachable, c.router]
    try:
        for p in procs:   # the router waits for its workers itself
            p.start()
        for p in procs:
            p.wait_healthy()
        c.wait_router_sees_all()
        yield Deployment(c, unreachable)
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def cluster(deployment):
    return deployment.cluster


@pytest.fixture(autouse=True)
def healthy(cluster):
    """Each test starts with every worker up and no fault, and leaves them so."""
    cluster.wait_router_sees_all()
    try:
        yield
    finally:
        for p in cluster.workers:
            p.signal(signal.SIGCONT)
        cluster.set_faults(cluster.workers, "")


# ---------------------------------------------------------------- helpers

def body(prompt: str = "The router in front of real workers", max_tokens: int = 6, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def complete(url: str, payload: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=timeout)


def sse(url: str, payload: dict, timeout: float = 120.0) -> tuple[int, list, bool]:
    """A streamed completion: (status, the JSON payloads of its events, whether [DONE] came last)."""
    events, done = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json={**payload, "stream": True}, timeout=timeout) as r:
        if r.status_code != 200:
            return r.status_code, [json.loads(r.read())], False
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert not done, "an event after [DONE]"
                if line == "data: [DONE]":
                    done = True
                else:
                    events.append(json.loads(line[6:]))
    return 200, events, done


class Held:
    """A completion sent over a raw connection whose answer is read only when asked for,
    so that a test can hold several requests in flight from one thread."""

    def __init__(self, url: str, payload: dict) -> None:
        u = httpx.URL(url)
        data = json.dumps(payload).encode()
        self.sock = socket.create_connection((u.host, u.port), timeout=120)
        self.sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {u.host}:{u.port}\r\nConnection: close\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)

    def response(self) -> tuple[int, dict]:
        """(status, JSON body), waiting for the server to answer and close."""
        raw = b""
        while chunk := self.sock.recv(65536):
            raw += chunk
        self.sock.close()
        head, _, payload = raw.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(payload)

    def close(self) -> None:
        self.sock.close()


def outcomes(url: str) -> Counter:
    """kvrelay_requests_finished_total of one process, by (outcome, reason)."""
    return Counter({(dict(ls)["outcome"], dict(ls)["reason"]): v for (n, ls), v in metric_samples(url).items()
                    if n == "kvrelay_requests_finished_total"})


class Ledger:
    """The finished-request counters of some processes now; `changes()` says what was added
    since, per process name (processes with no change are left out)."""

    def __init__(self, procs: list[Proc]) -> None:
        self.procs = list(procs)
        self.before = {p.name: outcomes(p.url) for p in self.procs}

    def changes(self) -> dict[str, dict]:
        out = {}
        for p in self.procs:
            diff = outcomes(p.url) - self.before[p.name]
            if diff:
                out[p.name] = dict(diff)
        return out


class LogMark:
    """The lines a process logs from now on."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.offset = proc.log.stat().st_size if proc.log.exists() else 0

    def lines(self, *words: str) -> list[str]:
        with open(self.proc.log, "rb") as f:
            f.seek(self.offset)
            text = f.read().decode(errors="replace")
        return [ln for ln in text.splitlines() if all(w in ln for w in words)]


def wait_for(check, what: str, cluster: Cluster, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{cluster.logs()}")
        time.sleep(0.1)


def workers_table(url: str) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(f"{url}/workers", timeout=10).json()["workers"]}


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def worker_proc(cluster: Cluster, name: str, role: str, tiny_llama_dir, port: int, *flags: str) -> Proc:
    argv = [role, "--model", f"random:{tiny_llama_dir}", "--dtype", "float32", "--max-kv-tokens", "16384",
            "--transfer-backend", "shm", *LIFECYCLE_FLAGS, "--enable-fault-injection", *flags]
    return Proc(name, argv, port, cluster.dir)


def assert_idle(worker: Proc) -> None:
    """A worker outside the module cluster: every phase gauge 0, every page free."""
    s = metric_samples(worker.url)
    phases = gauge(s, "kvrelay_requests")
    assert phases and not any(phases), (worker.name, phases)
    capacity = gauge(s, "kvrelay_kv_pages_capacity")
    assert capacity and gauge(s, "kvrelay_kv_pages_free") == capacity, worker.name


def token_request(rid: str, max_tokens: int = 6) -> GenerateRequest:
    return GenerateRequest(rid, (11, 12, 13, 14), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                 ignore_eos=True))


async def collect(outs) -> list:
    return [out async for out in outs]


async def run(router: RouterClient, rid: str, max_tokens: int = 6) -> list:
    return [out async for out in router.generate(token_request(rid, max_tokens))]


async def assert_no_leg_open(table) -> None:
    """Waits (a finished leg's task ends when its stream closes), then no worker has a leg open."""
    workers = table.workers("prefill") + table.workers("decode")
    for _ in range(500):
        if not any(w.outstanding for w in workers):
            break
        await asyncio.sleep(0.01)
    assert [w.outstanding for w in workers] == [0] * len(workers)


def router_finished(router: RouterClient) -> dict[tuple[str, str], float]:
    return {(s.labels["outcome"], s.labels["reason"]): s.value
            for m in router.metrics.registry.collect() if m.name == "kvrelay_requests_finished"
            for s in m.samples if s.name.endswith("_total")}


@contextlib.contextmanager
def router_records():
    """The log records of kvrelay.router while the block runs (INFO and up)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("kvrelay.router")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# ---------------------------------------------------------------- streaming

def test_a_request_streams_the_decode_tokens_back_with_usage_and_finish_reason(cluster):
    """Both legs run under the request's id and room (one on a prefill worker, one on the
    decode worker); the decode leg's tokens come back as one SSE event each, then the
    usage, then [DONE]; the streamed text equals the same request unstreamed."""
    router, decode = cluster.router, cluster.decode[0]
    ledger, marks = Ledger([router, *cluster.workers]), {p.name: LogMark(p) for p in [router, *cluster.workers]}
    payload = body("Tell me about disaggregated serving", 12)

    status, events, done = sse(router.url, {**payload, "stream_options": {"include_usage": True}})
    assert status == 200 and done, events
    *chunks, usage_event = events
    rid = chunks[0]["id"]
    assert rid.startswith("cmpl-") and all(e["id"] == rid and e["object"] == "text_completion" for e in events)
    assert {e["model"] for e in events} == {model_name(router.url)}   # the model the workers serve
    assert all(len(c["choices"]) == 1 and c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) >= 2   # streamed as it decodes, not one blob at the end
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 12
    usage = usage_event["usage"]
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + 12
    streamed = "".join(c["choices"][0]["text"] for c in chunks)

    whole = complete(router.url, payload)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0] == {"index": 0, "text": streamed, "logprobs": None, "finish_reason": "length"}
    assert whole.json()["usage"] == usage

    # The router's story of the streamed request, and each worker's, under the same room.
    (dispatched,) = marks["router"].lines("request dispatched", f"rid={rid} ")
    (ended,) = marks["router"].lines("request finished", f"rid={rid} ")
    assert "attempt=1 " in dispatched and f"decode={decode.url}" in dispatched
    assert "outcome=success reason=length attempts=1 tokens=12 " in ended
    room = dispatched.split("room=")[1].split()[0]
    prefill = next(p for p in cluster.prefill if f"prefill={p.url}" in dispatched)
    for worker in (prefill, decode):
        (line,) = marks[worker.name].lines("request ended", f"rid={rid} ")
        assert f"room={room} " in line and "phase=done" in line, line
    changes = ledger.changes()
    assert changes.pop("router") == {("success", "length"): 2}
    assert changes.pop(decode.name) == {("success", "done"): 2}
    assert sum(c[("success", "done")] for c in changes.values()) == 2 and all(len(c) == 1 for c in changes.values())
    wait_for(lambda: all(w["outstanding"] == 0 for w in workers_table(router.url).values()),
             "the router to count no open leg", cluster)
    cluster.assert_no_leak()


# ---------------------------------------------------------------- failures and the retry

def test_a_failed_prefill_leg_is_retried_once_on_another_pair(cluster):
    """prefill-0's KV writes fail (transfer_error). A request first sent there fails before
    any token: the try's other leg ends on the decode worker, and the request is sent again
    (a new room, leg id `<rid>-try2`) to prefill-1, where it succeeds. The client sees no
    error; every try is in the counters and the logs."""
    router, (p0, p1), decode = cluster.router, cluster.prefill, cluster.decode[0]
    ledger, mark, p1_mark = Ledger([router, *cluster.workers]), LogMark(router), LogMark(p1)
    cluster.set_faults([p0], "fail_transfer=1")
    # Among equally loaded prefill workers the router takes turns, and a retry makes p0
    # next again: of 4 requests in a row most start on p0.
    answers = [complete(router.url, body(f"retried request {i}")) for i in range(4)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert all(a.json()["usage"]["completion_tokens"] == 6 and a.json()["choices"][0]["finish_reason"] == "length"
               for a in answers)

    retried = mark.lines("request retried on another pair")
    assert len(retried) >= 1, mark.lines()
    assert all("transfer_error" in line for line in retried), retried   # the reason, as D or P reported it
    for answer in answers:
        rid = answer.json()["id"]
        (ended,) = mark.lines("request finished", f"rid={rid} ")
        assert "outcome=success reason=length" in ended and f"prefill={p1.url}" in ended
        tries = mark.lines("request dispatched", f"rid={rid} ")
        if any(f"rid={rid} " in line for line in retried):
            assert "attempts=2 " in ended and len(tries) == 2
            assert f"prefill={p0.url}" in tries[0] and f"prefill={p1.url}" in tries[1]
            rooms = {line.split("room=")[1].split()[0] for line in tries}
            assert len(rooms) == 2   # a new room for the new try
            (leg,) = p1_mark.lines("request ended", f"rid={rid}-try2 ")
            assert "phase=done" in leg
        else:
            assert "attempts=1 " in ended and len(tries) == 1

    n = len(retried)
    changes = wait_for(lambda: (c := ledger.changes()) and sum(c.get(p0.name, {}).values()) == n
                       and sum(c.get(decode.name, {}).values()) == 4 + n and c, "every leg to end", cluster)
    assert changes[router.name] == {("success", "length"): 4}
    assert changes[p1.name] == {("success", "done"): 4}
    # Each failed try's legs ended on their workers.
    assert set(changes[p0.name]) <= P_FAILED_TRY, changes
    first_tries = changes[decode.name]
    assert first_tries.pop(("success", "done")) == 4
    assert set(first_tries) <= D_FAILED_TRY, changes
    cluster.assert_no_leak()


def test_when_every_pair_fails_the_client_gets_the_error_with_its_reason(cluster):
    """Both prefill workers fail their KV writes: one try on each (the retry goes to the
    other pair), then a 503 (retryable) whose message names transfer_error."""
    router, (p0, p1) = cluster.router, cluster.prefill
    ledger, mark = Ledger([router, *cluster.workers]), LogMark(router)
    cluster.set_faults([p0, p1], "fail_transfer=1")
    r = complete(router.url, body("no pair can serve this"))
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    err = r.json()["error"]
    # The decode worker hears of P's failure and may report it first: "peer_failed: prefill: transfer_error".
    assert err["code"] in ("transfer_error", "peer_failed") and err["message"].startswith(err["code"] + ": ")
    assert "transfer_error" in err["message"] and err["type"] == "overloaded_error"
    rid = mark.lines("request dispatched")[0].split("rid=")[1].split()[0]
    (ended,) = mark.lines("request finished", f"rid={rid} ")
    assert f"outcome=failed reason={err['code']} attempts=2 " in ended
    changes = wait_for(lambda: (c := ledger.changes()) and all(sum(c.get(p.name, {}).values()) for p in (p0, p1))
                       and c, "the legs of both tries to end", cluster)
    assert changes[router.name] == {("failed", err["code"]): 1}
    for p in (p0, p1):   # one try on each
        assert sum(changes[p.name].values()) == 1 and set(changes[p.name]) <= P_FAILED_TRY, changes
    cluster.set_faults([p0, p1], "")
    assert complete(router.url, body("and now it works")).status_code == 200
    cluster.assert_no_leak()


def test_a_request_the_workers_reject_gets_their_400(cluster, tiny_llama_dir):
    """A token-id prompt outside the vocabulary passes the router's own checks (it knows no
    vocabulary) and is refused by the workers with a 400 before any room exists; the
    client gets that 400, streamed or not, and it is never retried."""
    router = cluster.router
    vocab = json.loads((Path(tiny_llama_dir) / "config.json").read_text())["vocab_size"]
    ledger, mark = Ledger([router, *cluster.workers]), LogMark(router)
    expected = {"error": {"message": f"token id {vocab + 7} is outside the vocabulary [0, {vocab})",
                          "type": "invalid_request_error", "param": "prompt", "code": "invalid_request"}}
    r = complete(router.url, body([5, 6, vocab + 7]))
    assert (r.status_code, r.json()) == (400, expected)
    status, events, _ = sse(router.url, body([5, 6, vocab + 7]))
    assert (status, events) == (400, [expected])
    ended = mark.lines("request finished")
    assert len(ended) == 2 and all("outcome=failed reason=invalid_request attempts=1 " in ln for ln in ended)
    assert not mark.lines("request retried")
    assert ledger.changes() == {router.name: {("failed", "invalid_request"): 2}}   # no worker started a leg
    cluster.assert_no_leak()


# ---------------------------------------------------------------- the deadline and admission

def test_a_client_abort_or_the_deadline_before_any_token_aborts_both_legs(deployment):
    """The decode worker paired with a prefill worker whose BootstrapInfo messages are
    dropped: it cannot learn that worker's transfer layout, so both legs wait in bootstrap
    (their own timeout is 30 s) and no KV can be written. A client abort ends such a
    request at once; with a 2 s request timeout the router ends it at 2 s with
    timeout:request. Either way both legs are aborted on the workers, there is no retry and
    nothing is left behind. Once the fault is off the same pair serves."""
    cluster, prefill = deployment.cluster, deployment.unreachable
    decode = cluster.decode[0]

    def both_legs_end(ledger: Ledger, marks: list[LogMark], rid: str) -> None:
        wait_for(lambda: len(ledger.changes()) == 2, "both legs to end", cluster)
        assert ledger.changes() == {prefill.name: {("aborted", "aborted"): 1},
                                    decode.name: {("aborted", "aborted"): 1}}
        for mark in marks:   # where each leg was when it was aborted
            (leg,) = mark.lines("request ended", f"rid={rid} ")
            assert "phase=aborted from_phase=bootstrap reason=aborted" in leg, leg

    def legs_live() -> bool:
        return sum(phase_gauges(prefill.url).values()) == sum(phase_gauges(decode.url).values()) == 1

    async def main():
        ledger, marks = Ledger([prefill, decode]), [LogMark(prefill), LogMark(decode)]
        async with router_client([prefill.url], [decode.url]) as router:
            with router_records() as records:
                task = asyncio.create_task(run(router, "abort-1"))
                while not (router.debug_rows() and await asyncio.to_thread(legs_live)):
                    assert not task.done(), task.result()
                    await asyncio.sleep(0.05)
                assert [row["phase"] for row in router.debug_rows()] == ["dispatched"]
                await router.abort("abort-1")
                outs = await task
                await router.close()   # the aborts have reached the workers
            assert [(o.finish_reason, o.error) for o in outs] == [(FinishReason.ABORT, None)]
            (ended,) = [r for r in records if r.getMessage() == "request finished"]
            assert (ended.outcome, ended.reason, ended.attempts) == ("aborted", "aborted", 1)
            assert router_finished(router) == {("aborted", "aborted"): 1}
            assert [w.outstanding for w in router.table.workers("prefill") + router.table.workers("decode")] == [0, 0]
        both_legs_end(ledger, marks, "abort-1")

        ledger, marks = Ledger([prefill, decode]), [LogMark(prefill), LogMark(decode)]
        async with router_client([prefill.url], [decode.url], request_timeout=2) as router:
            with router_records() as records:
                outs = await run(router, "deadline-1")
                await router.close()
            assert len(outs) == 1 and outs[0].finish_reason is FinishReason.ERROR
            assert outs[0].error.startswith("timeout:request: no complete answer within --request-timeout 2 s "
                                            "(phase dispatched)"), outs[0].error
            assert (outs[0].prompt_tokens, outs[0].completion_tokens) == (4, 0)
            (ended,) = [r for r in records if r.getMessage() == "request finished"]
            assert (ended.outcome, ended.reason, ended.attempts) == ("failed", "timeout:request", 1)
            assert [r.getMessage() for r in records].count("request dispatched") == 1
            assert router_finished(router) == {("failed", "timeout:request"): 1}
            assert [w.outstanding for w in router.table.workers("prefill") + router.table.workers("decode")] == [0, 0]
            assert router.debug_rows() == []
            both_legs_end(ledger, marks, "deadline-1")

        cluster.set_faults([prefill], "")
        async with router_client([prefill.url], [decode.url]) as router:
            outs = await run(router, "after-the-fault")
            assert outs[-1].finish_reason is FinishReason.LENGTH and sum(len(o.token_ids) for o in outs) == 6
    asyncio.run(main())
    assert_idle(prefill)
    cluster.assert_no_leak()


def test_shed_ttft_refuses_a_request_the_prefill_queue_predicts_late_and_admits_one_it_does_not(cluster):
    """--shed-ttft on the router: a prefill worker reports its measured seconds per prompt
    token and the prompt tokens it has queued; the router adds the prompt tokens it sent
    there since that report and refuses (503 overloaded, before any leg starts) a request
    whose predicted first token is later than the limit."""
    prefill, decode = cluster.prefill[0], cluster.decode[0]

    async def main():
        async with router_client([prefill.url], [decode.url]) as router:
            assert (await run(router, "measure"))[-1].finish_reason is FinishReason.LENGTH
            await router.monitor.check_all()
            health = router.table.get(prefill.url).health
        per_token = health.prefill_s_per_token
        assert per_token is not None and per_token > 0 and health.queued_prompt_tokens == 0, health
        # Limit: 10 prompt tokens' worth. A 4-token prompt fits; an 8-token one sent before
        # the next report does not (4 sent + 8); after the next report a 4-token one fits.
        async with router_client([prefill.url], [decode.url], shed_ttft=10 * per_token) as router:
            table = router.table
            assert table.get(prefill.url).health.prefill_s_per_token == per_token   # nothing prefilled since
            first = asyncio.create_task(run(router, "first", max_tokens=40))
            while table.get(prefill.url).sent_tokens == 0:
                assert not first.done(), first.result()
                await asyncio.sleep(0.01)
            assert table.get(prefill.url).predicted_wait(8) == pytest.approx(12 * per_token)
            longer = GenerateRequest("second", tuple(range(11, 19)), SamplingParams(max_tokens=6, ignore_eos=True))
            with pytest.raises(OpenAIError) as shed:
                _ = [out async for out in router.generate(longer)]
            assert (shed.value.status, shed.value.code, shed.value.headers) == (503, "overloaded", {"Retry-After": "1"})
            assert "predict" in shed.value.message and f"over --shed-ttft {10 * per_token:g} s" in shed.value.message
            assert (await first)[-1].finish_reason is FinishReason.LENGTH
            await router.monitor.check_all()   # a report after the first request: nothing sent since
            assert table.get(prefill.url).sent_tokens == 0
            assert (await run(router, "third"))[-1].finish_reason is FinishReason.LENGTH
            assert router_finished(router) == {("failed", "overloaded"): 1, ("success", "length"): 2}
            await router.close()
            await assert_no_leg_open(table)
    asyncio.run(main())
    cluster.assert_no_leak()


def test_the_adaptive_split_prefills_on_the_decode_worker_same_tokens_abortable_no_leak(cluster):
    """--decode-prefill-ttft: once the prefill worker's queue (the prompt tokens the router
    sent it since its last report) predicts a first token later than the limit, a request
    goes to the decode worker alone, which prefills it itself: no prefill leg, the same
    greedy tokens as through the pair, counted in kvrelay_router_prefilled_on_decode, and a
    client abort ends it on the decode worker with nothing left behind."""
    prefill, decode = cluster.prefill[0], cluster.decode[0]

    async def main():
        async with router_client([prefill.url], [decode.url]) as router:
            reference = await run(router, "through-the-pair", max_tokens=12)
            await router.monitor.check_all()
        assert router.table.get(prefill.url).health.prefill_s_per_token is not None
        async with router_client([prefill.url], [decode.url], decode_prefill_ttft=1e-9) as router:
            table = router.table
            longer = GenerateRequest("on-the-pair", tuple(range(11, 27)),
                                     SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            first = asyncio.create_task(collect(router.generate(longer)))
            while table.get(prefill.url).sent_tokens == 0:
                assert not first.done(), first.result()
                await asyncio.sleep(0.01)
            assert router.prefilled_on_decode == 0   # P had nothing queued: D predicted no sooner
            with router_records() as records:
                local = await run(router, "on-decode", max_tokens=12)
            assert [o.token_ids for o in local] == [o.token_ids for o in reference]
            assert local[-1].finish_reason is FinishReason.LENGTH and router.prefilled_on_decode == 1
            (sent,) = [r for r in records if r.getMessage() == "request dispatched"]
            assert (sent.prefill, sent.decode) == (decode.url, decode.url)
            assert table.get(prefill.url).sent_tokens == 16 and table.get(decode.url).sent_tokens == 4
            aborted = asyncio.create_task(run(router, "abort-on-decode", max_tokens=1000))
            while not [row for row in router.debug_rows() if row["id"] == "abort-on-decode"
                       and row["phase"] == "streaming"]:
                assert not aborted.done(), aborted.result()
                await asyncio.sleep(0.01)
            await router.abort("abort-on-decode")
            outs = await aborted
            assert outs[-1].finish_reason is FinishReason.ABORT and router.prefilled_on_decode == 2
            assert (await first)[-1].finish_reason is FinishReason.LENGTH
            metrics = {m.name: m for m in router.metrics.registry.collect()}
            assert metrics["kvrelay_router_prefilled_on_decode"].samples[0].value == 2
            assert router_finished(router) == {("success", "length"): 2, ("aborted", "aborted"): 1}
            await router.close()
            await assert_no_leg_open(table)
    asyncio.run(main())
    cluster.assert_no_leak()


def test_beyond_max_queued_requests_new_requests_get_503_with_retry_after(cluster):
    """Two requests held (the decode worker drops its Destination messages) fill the
    router's --max-queued-requests 2; a third gets 503 overloaded with Retry-After. With the
    fault off, the decode worker sends its Destination again, the held requests complete,
    and there is room again."""
    router, decode = cluster.router, cluster.decode[0]
    ledger = Ledger([router, *cluster.workers])
    cluster.set_faults([decode], "drop:Destination=1")
    held = [Held(router.url, body(f"held {i}")) for i in range(MAX_QUEUED)]
    try:
        wait_for(lambda: phase_gauges(router.url)["dispatched"] == MAX_QUEUED, "the held requests", cluster)
        r = complete(router.url, body("one too many"))
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"] == {
            "message": f"the router already holds {MAX_QUEUED} completions and this request asks for 1 "
                       f"(--max-queued-requests {MAX_QUEUED}); retry later",
            "type": "overloaded_error", "param": None, "code": "overloaded"}
        cluster.set_faults([decode], "")
        answers = [h.response() for h in held]
    finally:
        for h in held:
            h.close()
    assert [status for status, _ in answers] == [200] * MAX_QUEUED, answers
    assert all(a["usage"]["completion_tokens"] == 6 for _, a in answers)
    assert complete(router.url, body("room again")).status_code == 200
    changes = ledger.changes()
    assert changes.pop(router.name) == {("failed", "overloaded"): 1, ("success", "length"): MAX_QUEUED + 1}
    assert changes.pop(decode.name) == {("success", "done"): MAX_QUEUED + 1}
    assert sum(c[("success", "done")] for c in changes.values()) == MAX_QUEUED + 1   # the prefill workers
    cluster.assert_no_leak()


def test_with_no_healthy_decode_worker_the_client_gets_503(cluster):
    """The only decode worker frozen (SIGSTOP): its health checks time out, so it is slow
    (still picked, being the only one) until its lease ends; then the router marks it down
    and answers 503 no_healthy_worker naming it; after SIGCONT it rejoins."""
    router, decode = cluster.router, cluster.decode[0]
    ledger = Ledger([router])
    decode.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: not workers_table(router.url)[decode.url]["up"], "the router to mark it down", cluster)
        r = complete(router.url, body("nobody to decode this"))
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["code"] == "no_healthy_worker" and err["type"] == "overloaded_error"
        assert err["message"].startswith(f"no healthy decode worker ({decode.url}: "), err
        # Why it is down, as the table said then: its lease ran out.
        reason = err["message"].split(": ", 1)[1]
        assert reason.startswith("no good health check for"), reason
    finally:
        decode.signal(signal.SIGCONT)
    cluster.wait_router_sees_all()
    assert complete(router.url, body("decoded again")).status_code == 200
    assert ledger.changes() == {router.name: {("failed", "no_healthy_worker"): 1, ("success", "length"): 1}}
    cluster.assert_no_leak()


# ---------------------------------------------------------------- health checks and startup

def test_workers_of_another_role_or_model_are_kept_out_refused_at_startup_and_rejoin_once_fixed(
        cluster, tiny_llama_dir):
    """A router given prefill-1 as a decode worker, and a decode URL where nothing runs
    when it starts. Health checks keep prefill-1 out, and then a worker of another model
    started at that URL (--served-model-name other), although it answers every check:
    requests all go to decode-0. `kvrelay router` over the other-model worker refuses to
    start, with one line. Replaced by a right worker, the URL joins and serves; when that
    worker goes away unannounced, the request sent there is retried on decode-0."""
    (p0, p1), d0 = cluster.prefill, cluster.decode[0]
    port = free_port()
    x_url = f"http://127.0.0.1:{port}"
    other = worker_proc(cluster, "decode-other", "decode", tiny_llama_dir, port, "--served-model-name", "other")
    fixed = worker_proc(cluster, "decode-fixed", "decode", tiny_llama_dir, port)

    async def main():
        async with router_client([p0.url], [d0.url, p1.url, x_url]) as router:
            table = router.table
            assert [w.url for w in table.up("prefill") + table.up("decode")] == [p0.url, d0.url]
            assert table.get(p1.url).last_error == "reports role prefill, but was given as a decode worker"
            assert table.get(x_url).last_error.startswith("ConnectError")
            ledger = Ledger([p0, p1, d0])
            for i in range(3):
                assert (await run(router, f"only-d0-{i}"))[-1].finish_reason is FinishReason.LENGTH
            await router.close()
            assert ledger.changes() == {p0.name: {("success", "done"): 3}, d0.name: {("success", "done"): 3}}

            other.start()
            refused = subprocess.Popen(   # waits for the other-model worker like we do
                [sys.executable, "-m", "kvrelay", "router", "--model", f"random:{tiny_llama_dir}", "--prefill", p0.url,
                 "--decode", x_url, "--startup-timeout", "120", "--port", str(free_port())],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            cleanup.callback(lambda: refused.poll() is None and (refused.kill(), refused.wait()))
            other.wait_healthy()
            expected = f"serves model other, not {router.model_name}"
            for _ in range(3):   # it stays out, check after check, although it answers every one
                await router.monitor.check_all()
                x = table.get(x_url)
                assert (x.up, x.last_error, x.health) == (False, expected, None)
                assert table.get(p1.url).up is False
            assert [w.url for w in table.up("decode")] == [d0.url]

            out, err = refused.communicate(timeout=120)
            assert refused.returncode == 1 and out == "", out + err
            assert err.strip().splitlines()[-1] == ("kvrelay: error: the workers serve different models: "
                                                    f"{p0.url} serves {router.model_name}, {x_url} serves other")
            assert "Traceback" not in err

            other.stop()
            fixed.start().wait_healthy()
            with router_records() as records:
                await router.monitor.check_all()
            assert table.get(x_url).up and table.get(x_url).health.incarnation
            # x_url's own records (on a loaded host another worker may also answer late: "worker slow")
            assert [(r.getMessage(), r.worker) for r in records if r.worker == x_url] == [("worker joined", x_url)]
            assert not [r for r in records if r.getMessage() == "worker down"]
            ledger = Ledger([fixed, d0])
            for i in range(4):
                assert (await run(router, f"two-decode-workers-{i}"))[-1].finish_reason is FinishReason.LENGTH
            await router.close()
            changes = ledger.changes()
            assert changes[fixed.name][("success", "done")] >= 1   # it serves now
            assert changes[fixed.name][("success", "done")] + changes[d0.name][("success", "done")] == 4
            await router.monitor.check_all()
            assert table.get(p1.url).up is False   # the wrong role never gets in
            assert_idle(fixed)

            # It goes away between two health checks: the first leg sent there cannot connect,
            # the router marks it down at once and sends the request again to decode-0.
            fixed.stop()
            ledger = Ledger([p0, d0])
            with router_records() as records:
                for i in range(2):
                    assert (await run(router, f"after-it-left-{i}"))[-1].finish_reason is FinishReason.LENGTH
                await router.close()
            x = table.get(x_url)
            assert not x.up and x.last_error.startswith(f"{x_url}: ConnectError"), x.last_error
            messages = [r.getMessage() for r in records]
            assert messages.count("worker down") == 1 and messages.count("request retried on another pair") == 1
            (retried,) = [r for r in records if r.getMessage() == "request retried on another pair"]
            assert retried.error == f"peer_failed: {x.last_error}"
            # The first try's prefill leg was cancelled: aborted on prefill-0 if it had got there.
            changes = ledger.changes()
            assert changes[d0.name] == {("success", "done"): 2}
            assert changes[p0.name].pop(("success", "done")) == 2
            assert changes[p0.name] in ({}, {("aborted", "aborted"): 1}), changes
            assert router_finished(router) == {("success", "length"): 9}
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(stop_all, [other, fixed])
        asyncio.run(main())
    cluster.assert_no_leak()


# ---------------------------------------------------------------- the debug view

def test_debug_requests_aggregates_the_routers_rows_and_every_workers_view(cluster):
    """Two requests held before any KV moves (the decode worker drops its Destination
    messages): both legs of each are already live, one on a prefill worker and one on the
    decode worker, under the room the router gave it; the router's /debug/requests lists
    its own rows and each worker's view, and they agree. With the fault off both complete."""
    router, decode = cluster.router, cluster.decode[0]
    cluster.set_faults([decode], "drop:Destination=1")
    held = [Held(router.url, body(f"held for the debug view {i}")) for i in range(MAX_QUEUED)]
    try:
        wait_for(lambda: phase_gauges(router.url)["dispatched"] == MAX_QUEUED
                 and sum(phase_gauges(decode.url).values()) == MAX_QUEUED
                 and sum(sum(phase_gauges(p.url).values()) for p in cluster.prefill) == MAX_QUEUED,
                 "both legs of the held requests", cluster)
        view = httpx.get(f"{router.url}/debug/requests", timeout=10).json()
        cluster.set_faults([decode], "")
        answers = [h.response() for h in held]
    finally:
        for h in held:
            h.close()
    assert (view["role"], view["count"], len(view["requests"])) == ("router", MAX_QUEUED, MAX_QUEUED)
    assert set(view["workers"]) == {p.url for p in cluster.workers}
    for url, worker in view["workers"].items():
        assert worker["role"] == ("decode" if url == decode.url else "prefill")
        assert sum(worker["phases"].values()) == len(worker["requests"])
    assert sum(len(w["requests"]) for w in view["workers"].values()) == 2 * MAX_QUEUED
    for row in view["requests"]:
        assert (row["phase"], row["attempt"], row["decode"], row["tokens"]) == ("dispatched", 1, decode.url, 0)
        assert 0 < row["deadline_in"] <= 120 and row["age"] >= 0 and row["room"] >= 1
        legs = [(url, leg) for url, w in view["workers"].items() for leg in w["requests"] if leg["rid"] == row["id"]]
        assert sorted(url for url, _ in legs) == sorted([row["prefill"], decode.url]), legs
        for url, leg in legs:
            assert leg["room"] == row["room"] and leg["deadline_in"] > 0
            assert leg["side"] == ("decode" if url == decode.url else "prefill")
        # Before any KV moved: P still waits for D's destination, D has nothing to decode.
        phases = {leg["side"]: leg["phase"] for _, leg in legs}
        assert phases["prefill"] == "bootstrap" and phases["decode"] in ("bootstrap", "waiting"), phases
    assert [status for status, _ in answers] == [200] * MAX_QUEUED, answers
    after = httpx.get(f"{router.url}/debug/requests", timeout=10).json()
    assert after["count"] == 0 and all(w["requests"] == [] for w in after["workers"].values())
    cluster.assert_no_leak()

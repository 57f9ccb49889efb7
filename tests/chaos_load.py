"""The load of a chaos episode (tests/chaos.py): greedy completions of mixed prompt and
output lengths, streamed or not, some clients leaving mid-stream or aborting, and what
each client saw. A client's answer is judged here only for its shape (exactly one: a
completion, an OpenAI error body, or chunks + one error event + [DONE]); chaos.py judges
its timing and text."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
WORDS = ("the river ran past seven stone bridges while a small dog watched boats carry bread "
         "salt copper and letters toward the northern harbour where old sailors told stories").split()


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int
    prompt_tokens: int   # about one per word; only for the budget


def _job(k: int, words: int, max_tokens: int) -> Job:
    text = f"Story {k}: " + " ".join(WORDS[(k * 7 + i) % len(WORDS)] for i in range(words))
    return Job(text, max_tokens, words + 4)


# About 200 tokens/s per stream with 8 streams on this machine: most requests live for
# 1-4 s, across the faults, which begin 0.5-2.5 s into the episode.
JOBS = [_job(0, 4, 48), _job(1, 20, 200), _job(2, 60, 400), _job(3, 120, 120), _job(4, 10, 600),
        _job(5, 180, 300), _job(6, 35, 800), _job(7, 90, 64)]
LONG_JOBS = [_job(8, 250, 550), _job(9, 200, 650)]   # the saturating burst: ~54 pages each
ALL_JOBS = JOBS + LONG_JOBS
CLIENT_TIMEOUT = 75.0                # above the router's --request-timeout 60: silence is ours to see


@dataclass
class Call:
    """One client and what it saw."""
    job: int
    kind: str            # stream | plain | leave (stream, leaves after `leave_after` chunks) | abort
    at: float            # offset in the episode
    leave_after: float = 0.0
    t_start: float = 0.0
    t_end: float | None = None
    rid: str | None = None
    outcome: str = "none"          # ok | <error code> | left | aborted | none
    bound: float = 0.0             # when its answer was due (set by `judge`)
    text: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def owed(self) -> bool:
        return self.outcome not in ("left", "aborted")


def _error_code(body) -> str | None:
    """The code of an OpenAI error body, or None when `body` is not one."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err and "code" in err:
        return str(err["code"])
    return None


def _body(job: Job, stream: bool) -> dict:
    return {"prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def run_plain(url: str, call: Call, job: Job) -> None:
    timeout = httpx.Timeout(CLIENT_TIMEOUT, connect=5, read=call.leave_after or CLIENT_TIMEOUT)
    try:
        r = httpx.post(f"{url}/v1/completions", json=_body(job, False), timeout=timeout)
    except httpx.ReadTimeout:
        call.t_end = time.monotonic()
        if call.kind == "abort":
            call.outcome = "aborted"
        else:
            call.problems.append(f"silence: no answer within {CLIENT_TIMEOUT:g} s")
        return
    except httpx.HTTPError as exc:
        call.t_end = time.monotonic()
        call.problems.append(f"no answer: {type(exc).__name__}: {exc}")
        return
    call.t_end = time.monotonic()
    try:
        body = r.json()
    except ValueError:
        call.problems.append(f"HTTP {r.status_code} without a JSON body: {r.text[:120]!r}")
        return
    if r.status_code == 200:
        call.rid, call.outcome = body.get("id"), "ok"
        call.text = body["choices"][0]["text"]
    elif (code := _error_code(body)) is not None:
        call.outcome = code
    else:
        call.problems.append(f"HTTP {r.status_code} without an OpenAI error body: {body}")


def run_stream(url: str, call: Call, job: Job) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=_body(job, True),
                          timeout=httpx.Timeout(CLIENT_TIMEOUT, connect=5)) as r:
            if r.status_code != 200:
                call.t_end = time.monotonic()
                try:
                    code = _error_code(json.loads(r.read()))
                except ValueError:
                    code = None
                if code is None:
                    call.problems.append(f"HTTP {r.status_code} without an OpenAI error body")
                call.outcome = code or "none"
                return
            _read_events(r, call)
    except httpx.ReadTimeout:
        call.problems.append(f"silence: stream quiet for {CLIENT_TIMEOUT:g} s")
    except httpx.HTTPError as exc:
        call.problems.append(f"stream broke without [DONE]: {type(exc).__name__}: {exc}")
    if call.t_end is None:
        call.t_end = time.monotonic()


def _read_events(r: httpx.Response, call: Call) -> None:
    """One answer: chunks, then [DONE]; or chunks, one error event, [DONE]. Anything else
    (silence, a second error, data after [DONE]) is a problem."""
    chunks, error, done = 0, None, False
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if done:
            call.problems.append(f"data after [DONE]: {data[:80]!r}")
            continue
        if data == "[DONE]":
            done, call.t_end = True, time.monotonic()
            continue
        event = json.loads(data)
        if error is not None:
            call.problems.append(f"event after the error event: {data[:80]!r}")
        if "error" in event:
            error = _error_code(event)
            if error is None:
                call.problems.append(f"error event without an OpenAI error body: {data[:120]!r}")
                error = "none"
            continue
        chunks += 1
        call.rid = event.get("id", call.rid)
        call.text += "".join(ch["text"] for ch in event["choices"])
        if call.kind == "leave" and chunks >= call.leave_after:
            call.t_end, call.outcome = time.monotonic(), "left"
            return
    if not done:
        call.problems.append("stream ended without [DONE]")
    else:
        call.outcome = error or "ok"


def run_call(url: str, call: Call, t_zero: float) -> None:
    time.sleep(max(0.0, t_zero + call.at - time.monotonic()))
    call.t_start = time.monotonic()
    (run_stream if call.kind in ("stream", "leave") else run_plain)(url, call, ALL_JOBS[call.job])


def run_all(url: str, calls: list[Call], t_zero: float | None = None) -> None:
    t_zero = time.monotonic() if t_zero is None else t_zero
    threads = [threading.Thread(target=run_call, args=(url, c, t_zero), daemon=True) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CLIENT_TIMEOUT + 30)

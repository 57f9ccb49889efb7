"""Prometheus metrics shared by every kvrelay process (imports nothing from kvrelay).

Phase gauges are not incremented and decremented by hand: they are computed at scrape
time from a snapshot of the live requests, so `/metrics` can never drift from
`/debug/requests` (both read the same state; /metrics as of its render). So are the
engine's pool, token and preemption figures (`EngineStats`), kept as plain integers on the
engine thread. A process with an engine renders the snapshot its engine thread published
after its last iteration (`AsyncEngine.published`), never asking the engine itself; a
process renders at most once per RENDER_SPACING_S, however many scrapes come, and every
scrape gets a render begun after it arrived (`server.observe.Coalesced`).

Two views of the same data, side by side:
- kvrelay's own series (`kvrelay_*`), labelled `role` (colocated, prefill, decode, router)
  and `model_name`;
- the serving series a vLLM dashboard reads, under vLLM's names, buckets and meanings
  (`vllm:*`, labelled `model_name`), rendered at scrape time from kvrelay's own (one
  observation, two names: they cannot disagree). Each one comes from exactly one level, so
  that a dashboard summing over every target counts each request once: request timings
  and outcomes from the process clients talk to (the router, or a colocated server), queue
  time from where requests queue (a colocated engine, the prefill worker), and engine
  state from every engine (KV usage, running and waiting, tokens each engine computed,
  preemptions).

No `_created` series (`disable_created_metrics`): Prometheus does not read them and
`promtool check metrics` counts them as noise. No gauge ends in `_total`.

Rejected input: every decoder that drops something from the network calls
`reject_input(surface, reason, detail)`. It counts
    kvrelay_rejected_input_total{surface="control",reason="bad_field"} 1.0
(one process-wide counter, exported by every ServingMetrics registry) and logs at debug:
    kvrelay.input DEBUG rejected input  surface=control reason=bad_field detail="room: expected an integer, got dict"
Surfaces: "control" (wire frames on a worker's control port), "transfer" (KV data
frames), "http". Reasons are short codes (bad_field, bad_src, too_large, unknown_kind,
unknown_peer, ...); the detail is for the log only, never a label.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable

from prometheus_client import (CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_input_log = logging.getLogger("kvrelay.input")

REJECTED_INPUT = Counter("kvrelay_rejected_input", "Input from the network dropped by a decoder or admission check",
                         ["surface", "reason"], registry=None)


def reject_input(surface: str, reason: str, detail: str = "", src: str = "") -> None:
    """Count and log (debug) one dropped piece of input. Never raises."""
    REJECTED_INPUT.labels(surface, reason).inc()
    if _input_log.isEnabledFor(logging.DEBUG):
        _input_log.debug("rejected input", extra={"surface": surface, "reason": reason,
                                                  "detail": detail[:200], "src": src[:100]})


def rejected_count(surface: str, reason: str | None = None) -> float:
    """Current total for a surface (and reason): for tests and debug views."""
    total = 0.0
    for metric in REJECTED_INPUT.collect():
        for s in metric.samples:
            if (s.name.endswith("_total") and s.labels.get("surface") == surface
                    and reason in (None, s.labels.get("reason"))):
                total += s.value
    return total


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# vLLM's own buckets (vllm/v1/metrics/loggers.py), so that the vllm: histograms are theirs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)

# Renders of one process begin at least this far apart: a flood of scrapes costs one render
# per interval, each scrape waiting at most that long for one begun after it arrived.
RENDER_SPACING_S = 0.1

FRONT_DOOR = frozenset({"colocated", "router"})   # the roles clients talk to
QUEUES = frozenset({"colocated", "prefill"})      # the roles where requests wait for compute
# kvrelay (outcome, reason) -> vLLM's finished_reason
VLLM_FINISHED = {"stop": "stop", "length": "length"}


@dataclass
class PassStats:
    """An engine's forward passes since start. A pass that computes prompt tokens is a
    prefill pass (with whatever decodes ride in it), one of decodes only a decode step;
    seconds span the pass, its sampling and the hand-off of its outputs. Their ratios are
    what a step costs: decode_seconds / decode_steps at decode_sequences / decode_steps."""
    decode_steps: int = 0
    decode_sequences: int = 0   # the sequences each decode step advanced, summed
    decode_seconds: float = 0.0
    prefill_passes: int = 0
    prefill_tokens: int = 0     # prompt tokens those passes computed (recomputed ones too)
    prefill_seconds: float = 0.0

    def add(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens:
            self.prefill_passes += 1
            self.prefill_tokens += prompt_tokens
            self.prefill_seconds += seconds
        elif decodes:
            self.decode_steps += 1
            self.decode_sequences += decodes
            self.decode_seconds += seconds


@dataclass
class EngineStats:
    """What a process with a model reports of its engine (the router has none)."""
    running: int = 0            # requests in the batch being computed (vLLM's "running")
    waiting: int = 0            # requests admitted here that wait for compute, pages or KV
    kv_pages_free: int = 0
    kv_pages_capacity: int = 0
    preemptions: int = 0        # since start
    prompt_tokens: int = 0      # prompt tokens this engine prefilled, once per request
    generation_tokens: int = 0  # tokens this engine sampled (on P: each request's first)
    threads: int = 0            # threads its forward passes run on now (with --core-share: its part)
    yielded_seconds: float = 0.0  # since start: its decode steps waited for another engine's prompt (--core-share)
    passes: PassStats = field(default_factory=PassStats)
    other_load: float = 0.0     # cores of this host other processes keep busy, as last estimated (--leave-busy-cores)


@dataclass
class Snapshot:
    """What a process reports at scrape time."""
    phases: dict[str, list[float]] = field(default_factory=dict)  # phase -> ages (s) of live requests
    overdue: dict[str, int] = field(default_factory=dict)  # phase -> live requests past their phase deadline
    engine: EngineStats | None = None
    counters: dict[str, float] = field(default_factory=dict)  # name -> monotonically growing total
    gauges: dict[str, float] = field(default_factory=dict)    # name -> current value
    workers: list[tuple[str, str, bool]] = field(default_factory=list)  # the router's (url, role, up)


def _gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        g.add_metric(values, value)
    return g


def _counter(name: str, doc: str, labels: list[str], values: list[str], value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=labels)
    c.add_metric(values, value)
    return c


def _renamed(metric: Metric, name: str, doc: str, drop: str = "role") -> Metric:
    """`metric` under another family name, without the label `drop`."""
    out = Metric(name, doc, metric.type)
    for s in metric.samples:
        out.add_sample(name + s.name[len(metric.name):], {k: v for k, v in s.labels.items() if k != drop}, s.value)
    return out


class _SnapshotCollector:
    def __init__(self, metrics: "ServingMetrics", phases: tuple[str, ...], snapshot: Callable[[], Snapshot]) -> None:
        self.metrics, self.phases, self.snapshot = metrics, phases, snapshot

    def collect(self):
        snap, m = self.snapshot(), self.metrics
        own = [m.role, m.model_name]
        labels = ["role", "model_name"]
        yield _gauge("kvrelay_requests", "Live requests by role and phase", labels + ["phase"],
                     ((own + [p], len(snap.phases.get(p, []))) for p in self.phases))
        yield _gauge("kvrelay_oldest_request_age_seconds", "Age of the oldest live request in each phase",
                     labels + ["phase"], ((own + [p], max(snap.phases.get(p, []), default=0.0)) for p in self.phases))
        yield _gauge("kvrelay_requests_overdue", "Live requests past their phase's deadline (the watchdog ends "
                     "them within an iteration: a lasting value is a stuck request)", labels + ["phase"],
                     ((own + [p], snap.overdue.get(p, 0)) for p in self.phases))
        for name, value in snap.counters.items():
            yield _counter(name, name.replace("_", " "), labels, own, value)
        for name, value in snap.gauges.items():
            yield _gauge(name, name.replace("_", " "), labels, [(own, value)])
        if snap.workers:
            yield _gauge("kvrelay_worker_up", "1 while the router holds the worker's lease (its health checks "
                         "pass); role is the worker's", ["worker", "role", "model_name"],
                         (([url, role, m.model_name], float(up)) for url, role, up in snap.workers))
        if snap.engine is not None:
            yield from self._engine(snap.engine, own, labels)

    def _engine(self, e: EngineStats, own: list[str], labels: list[str]):
        model = [self.metrics.model_name]
        usage = 1.0 - e.kv_pages_free / e.kv_pages_capacity if e.kv_pages_capacity else 0.0
        yield _gauge("kvrelay_kv_pages_free", "Free KV pages", labels, [(own, e.kv_pages_free)])
        yield _gauge("kvrelay_kv_pages_capacity", "KV pages in the pool", labels, [(own, e.kv_pages_capacity)])
        yield _counter("kvrelay_prompt_tokens", "Prompt tokens this engine prefilled", labels, own, e.prompt_tokens)
        yield _counter("kvrelay_generation_tokens", "Tokens this engine sampled", labels, own, e.generation_tokens)
        yield _gauge("kvrelay_engine_threads", "Threads this engine's forward passes run on (with --core-share, "
                     "its part of the host's cores, set before each step)", labels, [(own, e.threads)])
        yield _gauge("kvrelay_engine_other_load_cores", "Cores of this host that other processes keep busy, as "
                     "this engine last estimated them (--leave-busy-cores: from 0.6 of one, a core is left to them)",
                     labels, [(own, e.other_load)])
        yield _counter("kvrelay_engine_yielded_seconds", "Seconds this engine's decode steps waited for another "
                       "engine's prompt on the shared cores (--core-share: prefill first)", labels, own,
                       e.yielded_seconds)
        p = e.passes
        for name, doc, value in (
                ("decode_steps", "Forward passes of decodes only", p.decode_steps),
                ("decode_sequences", "Sequences those decode steps advanced, summed over the steps",
                 p.decode_sequences),
                ("decode_seconds", "Seconds those decode steps took (pass, sampling, outputs handed off)",
                 p.decode_seconds),
                ("prefill_passes", "Forward passes that computed prompt tokens (with any decodes beside them)",
                 p.prefill_passes),
                ("prefill_tokens", "Prompt tokens those passes computed (recomputed ones too)", p.prefill_tokens),
                ("prefill_seconds", "Seconds those prefill passes took (pass, sampling, outputs handed off)",
                 p.prefill_seconds)):
            yield _counter(f"kvrelay_engine_{name}", doc, labels, own, value)
        yield _counter("kvrelay_preemptions", "Requests preempted (pages freed, recomputed later)", labels, own,
                       e.preemptions)
        vl = ["model_name"]
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", vl,
                     [(model, e.running)])
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", vl,
                     [(model, e.waiting)])
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", vl, [(model, usage)])
        yield _gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. DEPRECATED in vLLM: "
                     "use vllm:kv_cache_usage_perc.", vl, [(model, usage)])
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", vl, model, e.prompt_tokens)
        yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", vl, model,
                       e.generation_tokens)
        yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", vl, model,
                       e.preemptions)


class _VllmRequestCollector:
    """The vllm: request series, renamed from kvrelay's own at scrape time."""

    def __init__(self, metrics: "ServingMetrics") -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        for source, name, doc, roles in m.vllm_histograms:
            if m.role in roles:
                for metric in source.collect():
                    yield _renamed(metric, name, doc)
        if m.role in FRONT_DOOR:
            yield self._success()

    def _success(self) -> CounterMetricFamily:
        counts: dict[tuple[str, str], float] = {}
        for metric in self.metrics.finished.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    outcome, reason = s.labels["outcome"], s.labels["reason"]
                    why = VLLM_FINISHED.get(reason, "abort") if outcome != "failed" else "error"
                    key = (s.labels["model_name"], why)
                    counts[key] = counts.get(key, 0.0) + s.value
        c = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                labels=["model_name", "finished_reason"])
        for key, value in sorted(counts.items()):
            c.add_metric(list(key), value)
        return c


class ServingMetrics:
    """One registry per process. `role` labels every kvrelay series (colocated, prefill,
    decode, router), `model_name` every series; set it before the first observation (an
    engine core sets it to its model's served name when it is handed these metrics).
    `snapshot` is called once per render, on a scrape thread: it must not block (a
    process with an engine passes the one its engine thread published)."""

    def __init__(self, role: str, phases: tuple[str, ...], snapshot: Callable[[], Snapshot],
                 model_name: str = "") -> None:
        self.role, self.model_name = role, model_name
        self._render_lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(self, phases, snapshot))
        self.registry.register(REJECTED_INPUT)
        ProcessCollector(registry=self.registry)
        own = ["role", "model_name"]
        r = self.registry
        self.finished = Counter("kvrelay_requests_finished", "Requests that reached a terminal state",
                                own + ["outcome", "reason"], registry=r)
        self.phase_seconds = Histogram("kvrelay_phase_duration_seconds", "Time spent in each phase",
                                       own + ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvrelay_time_to_first_token_seconds", "Time from a request's arrival to its first "
                              "token, as its client sees it (router, colocated)", own, buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("kvrelay_inter_token_latency_seconds", "Time between two outputs of one request that "
                             "carry tokens (router, colocated)", own, buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("kvrelay_time_per_output_token_seconds", "A finished request's mean time per output "
                              "token after the first", own, buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("kvrelay_e2e_request_latency_seconds", "Time from a request's arrival to its end, "
                             "any outcome (router, colocated)", own, buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("kvrelay_request_queue_time_seconds", "Time from a request's arrival until its "
                               "prefill starts (colocated, prefill)", own, buckets=REQUEST_BUCKETS, registry=r)
        self.leg_first_token = Histogram(
            "kvrelay_leg_first_token_seconds", "Time from a leg's arrival at this worker to its first token leaving "
            "it: on prefill, the token sampled; on decode, the KV and token arrived from prefill",
            own, buckets=TTFT_BUCKETS, registry=r)
        # kvrelay histogram -> its vLLM name, exported by these roles only (see the module doc).
        self.vllm_histograms = (
            (self.ttft, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             FRONT_DOOR),
            (self.itl, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             FRONT_DOOR),
            (self.itl, "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds. "
             "DEPRECATED in vLLM: the same as vllm:inter_token_latency_seconds.", FRONT_DOOR),
            (self.tpot, "vllm:request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", FRONT_DOOR),
            (self.e2e, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
             FRONT_DOOR),
            (self.queue, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
             QUEUES),
        )
        r.register(_VllmRequestCollector(self))

    def _own(self, *extra: str) -> tuple[str, ...]:
        return (self.role, self.model_name, *extra)

    def record_finish(self, outcome: str, reason: str) -> None:
        self.finished.labels(*self._own(outcome, reason)).inc()

    def observe_phase(self, phase: str, seconds: float) -> None:
        self.phase_seconds.labels(*self._own(phase)).observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(*self._own()).observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.labels(*self._own()).observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.labels(*self._own()).observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.labels(*self._own()).observe(seconds)

    def observe_queue(self, seconds: float) -> None:
        self.queue.labels(*self._own()).observe(seconds)

    def observe_leg_first_token(self, seconds: float) -> None:
        self.leg_first_token.labels(*self._own()).observe(seconds)

    def render(self) -> bytes:
        """The exposition, now (`snapshot` is read once). One render at a time; the
        routes space them (`server.observe.Coalesced`)."""
        with self._render_lock:
            return generate_latest(self.registry)


# ---------------------------------------------------------------- re-export

class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def parse_families(text: str, labels: dict[str, str]) -> list[Metric]:
    """The families of one /metrics text, with `labels` added to each sample that lacks
    them (a worker's kvrelay series already carry their `role`). Raises ValueError."""
    out = []
    for family in text_string_to_metric_families(text):
        m = Metric(family.name, family.documentation, family.type)
        for s in family.samples:
            m.add_sample(s.name, {**labels, **s.labels}, s.value, s.timestamp, s.exemplar)
        out.append(m)
    return out


def render_families(families: Iterable[Metric]) -> bytes:
    """One exposition of `families`, those of one name merged (the format wants each
    family once)."""
    merged: dict[str, Metric] = {}
    for family in families:
        into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
        into.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)

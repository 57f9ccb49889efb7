"""Prometheus metrics shared by every kvrelay process (imports nothing from kvrelay).

Phase gauges are not incremented and decremented by hand: they are computed at scrape
time from a snapshot of the live requests, so `/metrics` can never drift from
`/debug/requests` (both read the same state).

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
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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


@dataclass
class Snapshot:
    """What a process reports at scrape time."""
    phases: dict[str, list[float]] = field(default_factory=dict)  # phase -> ages (s) of live requests
    kv_pages_free: int = 0
    kv_pages_total: int = 0
    counters: dict[str, float] = field(default_factory=dict)  # name -> monotonically growing total
    gauges: dict[str, float] = field(default_factory=dict)    # name -> current value


class _SnapshotCollector:
    def __init__(self, role: str, phases: tuple[str, ...], snapshot: Callable[[], Snapshot]) -> None:
        self.role, self.phases, self.snapshot = role, phases, snapshot

    def collect(self):
        snap = self.snapshot()
        count = GaugeMetricFamily("kvrelay_requests", "Live requests by role and phase", labels=["role", "phase"])
        oldest = GaugeMetricFamily("kvrelay_oldest_request_age_seconds",
                                   "Age of the oldest live request in each phase", labels=["role", "phase"])
        for phase in self.phases:
            ages = snap.phases.get(phase, [])
            count.add_metric([self.role, phase], len(ages))
            oldest.add_metric([self.role, phase], max(ages, default=0.0))
        free = GaugeMetricFamily("kvrelay_kv_pages_free", "Free KV pages", labels=["role"])
        free.add_metric([self.role], snap.kv_pages_free)
        total = GaugeMetricFamily("kvrelay_kv_pages_total", "Total KV pages", labels=["role"])
        total.add_metric([self.role], snap.kv_pages_total)
        extra = []
        for name, value in snap.counters.items():
            c = CounterMetricFamily(name, name.replace("_", " "), labels=["role"])
            c.add_metric([self.role], value)
            extra.append(c)
        for name, value in snap.gauges.items():
            g = GaugeMetricFamily(name, name.replace("_", " "), labels=["role"])
            g.add_metric([self.role], value)
            extra.append(g)
        return [count, oldest, free, total, *extra]


class ServingMetrics:
    """One registry per process. `role` labels every series (colocated, prefill, decode, router)."""

    def __init__(self, role: str, phases: tuple[str, ...], snapshot: Callable[[], Snapshot]) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(role, phases, snapshot))
        self.registry.register(REJECTED_INPUT)
        self.finished = Counter("kvrelay_requests_finished", "Requests that reached a terminal state",
                                ["role", "outcome", "reason"], registry=self.registry)
        self.phase_seconds = Histogram("kvrelay_phase_duration_seconds", "Time spent in each phase",
                                       ["role", "phase"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("kvrelay_time_to_first_token_seconds", "Time to first token",
                              ["role"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kvrelay_time_per_output_token_seconds", "Mean time per output token after the first",
                              ["role"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def record_finish(self, outcome: str, reason: str) -> None:
        self.finished.labels(self.role, outcome, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

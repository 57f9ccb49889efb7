"""One simulated run per seed: build the cluster, play the load and the fault schedule,
check every invariant while it runs and once it is idle.

Invariants (docs/lifecycle.md names them; `Violation.invariant` is the name):
    one-answer       every client request that stays gets exactly one terminal answer
                     (a final output per choice, or an error raised before any output)
    answer-bound     ... within --request-timeout of its arrival
    same-tokens      a request (each choice) that succeeded returned the tokens of a fault-free run
    kv-intact        every running request's KV pages hold exactly its own tokens' KV
                     (a write that lands after its epoch changed breaks this)
    no-late-write    every byte a transfer lands in D's pool goes to pages its room still
                     owns (reserved, or quarantined after a failure); seen by the fake
                     backends' `on_land` hook as the bytes land
    termination      after every iteration of a worker, no live room has outlived the bound
                     lifecycle.md's phase tables give its phase (the configured timeout,
                     not the room's own deadline field: a phase left without one counts)
    not-cut          in a run with no process or network fault (client aborts and
                     disconnects only), no room ends peer_failed or transfer_error on a
                     judgment of its own (a lease, a transfer's progress), as opposed to
                     its peer telling it that its copy ended: a slow transfer that moves
                     is never cut, however long it takes
    peer-end         a room that one side ends early (failed, aborted) while its peer still
                     depends on it ends on the peer in the peer's first iteration after the
                     notice can have arrived, when the link was clean as it was sent
    leg-lease        no router leg stays open on a worker more than one reaper pass (a
                     quarter health interval) after the worker's last good health check
                     (or leg output) plus its lease plus the router's own stalls since
                     (its loop standing still, a clock jump: the judge was blind then)
    judge-stall      a lease verdict (the router declaring a worker dead; a worker failing
                     a room because its peer missed its heartbeats) names a worker that a
                     fault could have silenced towards its judge recently (a freeze, crash,
                     slow steps or a cut of its own, or of the link between them): a stall
                     of the judge alone (the router's loop standing still, a clock jump) is
                     never held against a peer
    no-starvation    the head of a worker's waiting queue, while the batch has room and the
                     pages for its next chunk are free, is scheduled within 3 iterations
    pages-owned-once the allocator's integrity check: every used page in exactly one owner
                     group, its reference count equal to its holders, none lost
    idle-whole       once idle: every pool whole, every phase gauge 0, nothing live
    debug-is-metrics a worker's /debug/requests phase counts equal its kvrelay_requests gauges

With `SimConfig.max_n` > 1 some requests ask for n > 1 choices (drawn from a stream of
their own), sampled with a seed, so that the choices diverge: each choice must return
what the production sampler gives it on a fault-free run (`model.expected_sampled`: P
samples every choice's first token, D the rest), and every running choice's pages (the
shared prompt pages, its own copy of the last one) must hold its own KV.

Beyond the first cut, each seed also draws (from a stream of its own, so that requests
and faults stay what they were): KV written in pieces over a slow data path, P->D links
slower than the lease (the bytes queue on the link, as over tcp), one-sided writes in
flight for a while, router->worker request latency, and shorter phase deadlines, so that
a deadline rather than a lease is what must end a room.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass, field, replace

import torch

from kvrelay.core import ids
from kvrelay.core.clock import SimClock
from kvrelay.core.config import KVCacheConfig, LifecycleConfig, RouterConfig, SchedulerConfig, TransferConfig
from kvrelay.disagg.lifecycle import DPhase, PPhase
from kvrelay.disagg.transfer.base import TransferStatus as S
from kvrelay.engine.scheduler import pages_for
from kvrelay.engine.types import FinishReason, GenerateRequest, RequestRejected, SamplingParams
from kvrelay.obs.metrics import ServingMetrics
from kvrelay.server.errors import OpenAIError
from kvrelay.sim import faults as fl
from kvrelay.sim import loop
from kvrelay.sim.cluster import CORES, Costs, SimRouter, SimWorker
from kvrelay.sim.loop import in_process
from kvrelay.sim.model import chain, expected_sampled, expected_tokens, sim_loaded
from kvrelay.sim.net import SimNetwork

SETTLE_POLL = 0.1


class Violation(AssertionError):
    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant, self.detail = invariant, detail

    def __reduce__(self):   # results cross process boundaries (--jobs)
        return Violation, (self.invariant, self.detail)


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int = 1
    num_decode: int = 2
    requests: int = 20
    window: float = 3.0           # seconds over which requests arrive and faults start
    max_faults: int = 4
    max_n: int = 1                # choices per request drawn from 1..max_n (1: every request n=1)
    split: int = 1                # 1: the router's --decode-prefill-ttft drawn per seed; 0: always off


@dataclass
class Request:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    arrival: float
    n: int = 1
    seed: int | None = None       # sampled (temperature 1) with this seed; None: greedy


@dataclass
class Answer:
    start: float = 0.0
    end: float | None = None
    outputs: list = field(default_factory=list)
    error: str | None = None
    terminal: int = 0
    left: bool = False
    n: int = 1
    ended: set = field(default_factory=set)   # choices whose final output came


@dataclass
class Result:
    seed: int
    schedule: list[fl.Fault]
    violation: Violation | None
    sim_seconds: float
    outcomes: dict[str, int]
    prefilled_on_decode: int = 0   # requests the router's adaptive split gave a decode worker whole

    @property
    def ok(self) -> bool:
        return self.violation is None


class Sim:
    def __init__(self, seed: int, cfg: SimConfig = SimConfig(), schedule: list[fl.Fault] | None = None) -> None:
        self.seed, self.cfg = seed, cfg
        rng = random.Random(seed)
        self.rng = rng
        self.clock = SimClock(1000.0)
        self.net = SimNetwork(self.clock, random.Random(rng.getrandbits(64)))
        self.loaded = sim_loaded(eos_ok=rng.random() < 0.5)
        self.sched = SchedulerConfig(max_running_requests=rng.choice([4, 16]),
                                     max_prefill_tokens=rng.choice([16, 64, 256]))
        self.lifecycle = LifecycleConfig(heartbeat_interval=0.5, heartbeat_misses=3, bootstrap_timeout=8.0,
                                         queue_timeout=10.0, waiting_timeout=10.0, transfer_timeout=6.0,
                                         quarantine_grace=1.0)
        self.transfer = TransferConfig(transfer_backend=rng.choice(["fake", "fake-twosided"]))
        self.write_iters = rng.choice([1, 1, 3])
        self._draw_more(random.Random(seed ^ 0x7E57))
        # The adaptive split, from a stream of its own: a limit this low moves every request
        # that finds P's queue behind it to its decode worker.
        split = random.Random(seed ^ 0x5B117).choice([0.0, 0.0, 0.002, 0.05]) if cfg.split else 0.0
        self.router_cfg = RouterConfig(request_timeout=30.0, health_interval=0.5, health_timeout=1.0,
                                       health_misses=3, decode_prefill_ttft=split)
        self.costs = Costs()
        small = rng.random() < 0.3     # a decode pool too small: preemption and waiting for pages
        self.workers = [SimWorker(self, "prefill", i, KVCacheConfig(page_size=4, max_kv_tokens=2048))
                        for i in range(cfg.num_prefill)]
        self.workers += [SimWorker(self, "decode", i, KVCacheConfig(
            page_size=4, max_kv_tokens=rng.choice([96, 160]) if small and i == cfg.num_decode - 1 else 2048))
            for i in range(cfg.num_decode)]
        self.requests = [self._draw_request(i) for i in range(cfg.requests)]
        if cfg.max_n > 1:   # a stream of its own: the requests and faults stay what they were
            choices = random.Random(seed ^ 0xC401CE)
            for r in self.requests:
                r.n = choices.choice([1, 1, choices.randint(2, cfg.max_n)])
                r.seed = choices.randrange(1 << 31) if r.n > 1 else None
        lease = self.lifecycle.heartbeat_interval * self.lifecycle.heartbeat_misses
        self.schedule = schedule if schedule is not None else sorted(fl.draw(
            rng, [w.name for w in self.workers if w.role == "prefill"],
            [w.name for w in self.workers if w.role == "decode"], [r.rid for r in self.requests],
            cfg.window, lease, cfg.max_faults) + fl.draw_stalls(random.Random(seed ^ 0x57A11), cfg.window,
                                                                self.router_cfg.health_lease),
            key=lambda f: (f.at, f.kind, f.target))
        # clients' faults and the router's own stalls only: no worker or link is at fault
        self.quiet = all(f.kind in ("abort", "disconnect", "stall") for f in self.schedule)
        self.answers: dict[str, Answer] = {}
        self.router: SimRouter | None = None
        self.metrics: dict[str, ServingMetrics] = {}
        self._checked: dict[str, set[str]] = {}
        self.violation: Violation | None = None
        self.t0 = 0.0
        self.blind: list[tuple[float, float]] = []   # (from, to): the router's stalls and clock jumps
        self._pools: dict[str, SimWorker] = {}             # fake pool id -> the worker it belongs to
        self._peer_end: dict[str, dict[int, float]] = {}   # address -> {room: when it must have ended}
        self._starving: dict[str, tuple] = {}              # worker -> (waiting head, admissible, iterations)

    def _draw_more(self, rng: random.Random) -> None:
        """Choices added after the first cut, from a stream of their own so that the
        requests and faults each seed drew before stay the same: KV that lands in pieces
        over a slow data path, one-sided writes that stay in flight a while (so "may still
        write" is real), router->worker request latency (so the router's aborts do not
        always beat the P<->D notices), and phase deadlines shorter than the defaults (an
        operator's choice), so that a deadline, not a lease, is what must end a room."""
        self.chunk_pages = rng.choice([0, 0, 1, 2, 4])
        self.chunk_interval = rng.choice([0.0, 0.05, 0.3]) if self.chunk_pages else 0.0
        self.land_delay = rng.choice([0.0, 0.0, 0.1, 0.8])    # one-sided writes in flight
        self.http_latency = rng.choice([0.0, 0.002, 0.01])   # router -> worker requests
        if rng.random() < 0.3:
            self.lifecycle = replace(self.lifecycle, waiting_timeout=rng.choice([1.5, 3.0]),
                                     transfer_timeout=rng.choice([1.5, 3.0, 6.0]))
        # Drawn last, so the draws above stay what they were: P->D links slower than the
        # lease (a 10-page room takes 2.5-5 s to land); P hands its writes off at once, so
        # the bytes wait on the link, as over tcp, not in P's write, and only D's reports
        # of bytes landed show the transfer moving.
        self.link_rate = rng.choice([256.0, 512.0]) if rng.random() < 0.3 else 0.0
        if self.link_rate:
            self.chunk_pages, self.chunk_interval = 0, 0.0
        lc = self.lifecycle
        self.bounds = {      # lifecycle.md's phase tables: what bounds each phase
            "prefill": {PPhase.BOOTSTRAP: lc.bootstrap_timeout, PPhase.QUEUED: lc.queue_timeout,
                        PPhase.PREFILL: None, PPhase.TRANSFER: lc.transfer_timeout},
            "decode": {DPhase.BOOTSTRAP: lc.bootstrap_timeout, DPhase.WAITING: lc.waiting_timeout,
                       DPhase.DECODE: lc.max_request_time}}

    def _draw_request(self, i: int) -> Request:
        rng = self.rng
        n = rng.randint(1, 40)
        return Request(f"r{i}", tuple(rng.randrange(1, 64) for _ in range(n)), rng.randint(1, 24),
                       rng.random() < 0.5, round(rng.uniform(0.0, self.cfg.window), 3))

    # ---- running ---------------------------------------------------------------------------
    def run(self) -> Result:
        ids.use(random.Random(self.seed ^ 0x51D))
        try:
            loop.run(self._guarded(), self.clock)
        except loop.Stalled as e:
            self.violation = self.violation or Violation("no-stall", str(e))
        finally:
            ids.use(None)
        outcomes: dict[str, int] = {}
        for a in self.answers.values():
            key = "left" if a.left else a.error.split(":")[0] if a.error else (
                a.outputs[-1].finish_reason.value if a.outputs and a.outputs[-1].finish_reason else "none")
            outcomes[key] = outcomes.get(key, 0) + 1
        client = self.router.client if self.router is not None else None
        return Result(self.seed, self.schedule, self.violation, self.clock.now() - 1000.0, outcomes,
                      client.prefilled_on_decode if client is not None else 0)

    def fail(self, v: AssertionError) -> None:
        """The first violation ends the run, whichever task found it (an assertion from a
        production integrity check counts as `pages-owned-once`)."""
        if not isinstance(v, Violation):
            v = Violation("pages-owned-once", str(v))
        if self.violation is None:
            self.violation = v
            self._main_task.cancel()

    async def _guarded(self) -> None:
        self._main_task = asyncio.current_task()
        try:
            await self._main()
        except Violation as v:
            self.fail(v)
        except asyncio.CancelledError:
            if self.violation is None:
                raise

    async def _main(self) -> None:
        for w in self.workers:
            w.start()
            self._watch(w)
        for p in (w for w in self.workers if w.role == "prefill" and self.link_rate):
            for d in (w for w in self.workers if w.role == "decode"):
                self.net.link(p.address, d.address).rate = self.link_rate
        self.router = SimRouter(self.router_cfg, self.workers, self.loaded.tokenizer, self.clock, self.http_latency)
        await self.router.start()
        self.t0 = self.clock.now()
        monitor = self.router.monitor
        reap = monitor.reap

        def reaped() -> list[str]:
            out = reap()
            for url in out:
                self._verdict(fl.ROUTER, url)
            return out
        monitor.reap = reaped
        lp = asyncio.get_running_loop()
        watch = lp.create_task(self._watch_legs())
        for f in self.schedule:
            lp.call_at(self.t0 + f.at, self._apply, f, True)
            if f.duration and f.kind not in ("abort", "disconnect", "clock_jump"):
                lp.call_at(self.t0 + f.at + f.duration, self._apply, f, False)
        leave = {f.target: f for f in self.schedule if f.kind == "disconnect"}
        # A client's request is handled in the router: its task is the router's (stalls with it).
        clients = [lp.create_task(self._client(r, leave.get(r.rid)), context=in_process(fl.ROUTER))
                   for r in self.requests]
        await asyncio.gather(*clients)
        last_fault = max((f.at + f.duration for f in self.schedule), default=0.0)
        await asyncio.sleep(max(0.0, self.t0 + last_fault - self.clock.now()))
        await self._settle()
        self._check_idle()
        watch.cancel()
        await self.router.close()

    def _watch(self, w: SimWorker) -> None:
        self._checked[w.name] = set()
        core = w.core
        self.metrics[w.name] = ServingMetrics(w.role, CORES[w.role].PHASES, core.snapshot)
        self._pools[core.manager.pool_id] = w
        core.manager.on_land = self._on_land
        lc, inner = core.side.lc, core.side.lc.on_terminal

        def on_terminal(ev) -> None:
            self._not_cut(w, ev)
            self._ended(w, ev)
            if inner is not None:
                inner(ev)
        lc.on_terminal = on_terminal
        side, dead = core.side, core.side.leases.dead

        def verdicts() -> list[str]:   # the peers this worker's leases find dead, rooms depending on them
            out = dead()
            for address in out:
                if any(r.peer == address and side._depends_on_peer(r) for r in side.lc.rooms.values()):
                    self._verdict(w.name, address)
            return out
        side.leases.dead = verdicts

    def _verdict(self, judge: str, accused: str) -> None:
        """Called from inside a worker's iteration or the router's reaper: reports through
        `fail` rather than raising into production code."""
        name = next((w.name for w in self.workers if accused in (w.url, w.address)), accused)
        try:
            self._judged(judge, name)
        except Violation as v:
            self.fail(v)

    # ---- faults ----------------------------------------------------------------------------
    def _worker(self, name: str) -> SimWorker:
        return next(w for w in self.workers if w.name == name)

    def _apply(self, f: fl.Fault, on: bool) -> None:
        kind = f.kind
        if kind in ("link", "partition"):
            p, d = (self._worker(n).address for n in f.target.split(">"))
            if kind == "partition":
                self.net.partition(p, d, on)
            else:
                for link in (self.net.link(p, d), self.net.link(d, p)):
                    link.drop, link.dup, link.reorder = ((f.params["drop"], f.params["dup"], f.params["reorder"])
                                                         if on else (0.0, 0.0, 0.0))
                    link.extra_delay = f.params["delay"] if on else 0.0
        elif kind == "http_cut":
            ev = self._worker(f.target).http_ok
            ev.clear() if on else ev.set()
        elif kind == "freeze":
            w = self._worker(f.target)
            w.freeze() if on else w.thaw()
        elif kind == "crash":
            w = self._worker(f.target)
            if on:
                w.crash()
                if not f.duration:
                    asyncio.get_running_loop().call_soon(self._restart, w)
            else:
                self._restart(w)
        elif kind == "slow":
            self._worker(f.target).slow = f.params["factor"] if on else 1.0
        elif kind == "transfer":
            spec = ";".join(f"{k}={v}" for k, v in f.params.items()) + f";seed={self.seed}"
            self._worker(f.target).set_transfer_faults(spec if on else "")
        elif kind == "clock_jump":
            start = self.clock.now()
            self.clock.advance(f.params["seconds"])
            self.blind.append((start, self.clock.now()))
        elif kind == "stall":
            now = self.clock.now()
            asyncio.get_running_loop().stall(f.target, now + f.duration)
            self.blind.append((now, now + f.duration))
        elif kind == "abort" and self.router is not None and self.router.client is not None:
            asyncio.get_running_loop().create_task(self.router.client.abort(f.target))

    def _restart(self, w: SimWorker) -> None:
        if w.state == "down":
            w.restart()
            self._watch(w)

    # ---- clients ---------------------------------------------------------------------------
    async def _client(self, req: Request, leave: fl.Fault | None) -> None:
        await asyncio.sleep(max(0.0, self.t0 + req.arrival - self.clock.now()))
        client = self.router.client
        greq = GenerateRequest(req.rid, req.prompt, self._params(req), whole=not req.stream)
        ans = self.answers[req.rid] = Answer(start=self.clock.now(), n=req.n)
        gen = client.generate(greq)
        leave_at = self.t0 + leave.at if leave is not None else None
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(max(leave_at, self.clock.now()) if leave_at else None):
                    await self._consume(gen, ans, leave)
            if leave is not None and ans.end is None:
                ans.left = True
                await client.abort(req.rid)           # what the HTTP layer does on a disconnect
        finally:
            await gen.aclose()
        if not ans.left:
            self._check_answer(req, ans)

    @staticmethod
    def _params(req: Request) -> SamplingParams:
        return SamplingParams(max_tokens=req.max_tokens, temperature=0.0 if req.seed is None else 1.0,
                              seed=req.seed, n=req.n)

    async def _consume(self, gen, ans: Answer, leave: fl.Fault | None) -> None:
        try:
            async for out in gen:
                if out.index in ans.ended or not 0 <= out.index < ans.n:
                    raise Violation("one-answer", f"{out.rid}: an output of choice {out.index} after its final one "
                                                  f"(or of no choice: n={ans.n})")
                ans.outputs.append(out)
                if out.finished:
                    ans.ended.add(out.index)
                    ans.terminal += 1
                    if len(ans.ended) == ans.n:
                        ans.end = self.clock.now()
                if leave is not None and len(ans.outputs) >= leave.params.get("count", 0) and not out.finished:
                    return
        except (OpenAIError, RequestRejected) as exc:
            if ans.outputs:
                raise Violation("one-answer", f"an error after {len(ans.outputs)} outputs: {exc}") from None
            ans.error, ans.terminal, ans.end = f"{getattr(exc, 'code', None) or 'rejected'}: {exc}", 1, self.clock.now()

    def _check_answer(self, req: Request, ans: Answer) -> None:
        if ans.terminal != (1 if ans.error else req.n) or ans.end is None:
            raise Violation("one-answer", f"{req.rid} got {ans.terminal} terminal answers for n={req.n}")
        bound = self.router_cfg.request_timeout + 0.5
        if ans.end - ans.start > bound:
            raise Violation("answer-bound", f"{req.rid} answered after {ans.end - ans.start:.2f}s > {bound}s")
        eos_ok = self.loaded.model.eos_ok
        for i in range(req.n):
            outs = [o for o in ans.outputs if o.index == i]
            if outs and outs[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                got = [t for o in outs for t in o.token_ids]
                want = (expected_tokens(list(req.prompt), req.max_tokens, eos_ok) if req.seed is None
                        else expected_sampled(list(req.prompt), self._params(req), i, eos_ok))
                if got != want:
                    raise Violation("same-tokens", f"{req.rid} choice {i}: {got} != {want}")

    # ---- invariants while running ----------------------------------------------------------
    def after_iteration(self, w: SimWorker) -> None:
        core = w.core
        now = self.clock.now()
        bounds = self.bounds[w.role]
        for r in core.side.lc.rooms.values():
            limit = bounds[r.phase]   # the documented bound, not the room's own deadline field
            if limit is not None and now >= r.entered + limit:
                raise Violation("termination", f"{w.name}: room {r.room} ({r.rid}) still in {r.phase.name.lower()} "
                                               f"{now - r.entered - limit:.3f}s past its {limit:g}s deadline")
        if self._peer_end.get(w.address):
            self._check_peer_end(w, now)
        self._check_progress(w)
        seen = self._checked[w.name]
        full = w.iterations % 16 == 0
        for req in core.engine.scheduler.running:
            if full or (req.rid, req.index) not in seen:
                self._check_kv(w, req)
                seen.add((req.rid, req.index))
        if full:
            core.engine.allocator.check_integrity()
            if w.iterations % 64 == 0:
                self._check_debug_view(w)

    def _on_land(self, pool_id: str, room: int, epoch: int, pages) -> None:
        """no-late-write: bytes of (room, epoch) land only in pages the room still owns
        (reserved, or quarantined after a failure). Called from inside an iteration, so
        it reports through `fail` rather than raising into the engine loop."""
        w = self._pools.get(pool_id)
        if w is None or w.core is None or w.core.manager.pool_id != pool_id or self.violation is not None:
            return
        alloc = w.core.engine.allocator
        bad = [(p, alloc.holders(p)) for p in pages if alloc.holders(p) != [("room", room)]]
        if bad:
            self.fail(Violation("no-late-write", f"bytes of room {room} epoch {epoch} land in {w.name}'s pages "
                                                 f"owned by others now (page, owner): {bad[:4]}"))

    def _not_cut(self, w: SimWorker, ev) -> None:
        """not-cut: with no fault but the clients' own, nothing may end for a lease reason.
        A room its peer ended (a deadline there) ends peer_failed here with the peer's word
        in the detail (its notice, or its phase in a heartbeat): that is not a cut."""
        told = ev.detail.startswith(("prefill: ", "decode: ")) or (
            ev.detail.startswith(("prefill side is ", "decode side is ")) and "before" not in ev.detail)
        if self.quiet and ev.reason in ("peer_failed", "transfer_error") and not told:
            self.fail(Violation("not-cut", f"{w.name}: room {ev.room} ({ev.rid}) ended {ev.reason} "
                                           f"from {ev.from_phase} in a run with no fault: {ev.detail}"))

    def _ended(self, w: SimWorker, ev) -> None:
        """peer-end, when a room ends early on one side: the peer is told (a Notice), so over
        a clean link the peer's copy must end in its first iteration after the Notice can
        have arrived (lifecycle.md: abort is honoured within one scheduler iteration on both
        sides; the peer says it aborted). Over a lossy link heartbeats are the backup, and
        their bound is the lease, which the other invariants hold.
        The Notice may have gone before the room's end here (a transfer that failed inside
        a long pass tells D at once; the room ends at the step's end): then what happened
        to that Notice decides, whatever the link is like now."""
        if ev.phase not in ("failed", "aborted"):
            return
        m = w.core.manager
        ep = m._senders.get(ev.room) if w.role == "prefill" else m._receivers.get(ev.room)
        if ep is None or ep.peer_address is None or (w.role == "prefill" and ep.dest is None):
            return   # the peer never learned of this side's endpoint: nothing to tell it yet
        net, peer = self.net, ep.peer_address
        sent = net.notices.get((w.address, peer, ev.room))
        if sent is not None:   # arrived: the peer acts on it; lost ([]): heartbeats tell it, within its lease
            if sent:
                self._peer_end.setdefault(peer, {})[ev.room] = min(sent)
            return
        link = net.links.get((w.address, peer))
        if link is not None and (link.down or link.drop):
            return
        due = self.clock.now() + net.base_latency + net.jitter + (link.extra_delay if link is not None else 0.0)
        self._peer_end.setdefault(peer, {})[ev.room] = max(due, net._last.get((w.address, peer), 0.0))

    def _check_peer_end(self, w: SimWorker, now: float) -> None:
        pending, side = self._peer_end[w.address], w.core.side
        for room, due in list(pending.items()):
            if now < due:
                continue
            del pending[room]
            r = side.lc.rooms.get(room)
            ep = (side._senders if w.role == "prefill" else side._receivers).get(room) if r is not None else None
            if ep is not None and ep.poll() is not S.SUCCESS:
                raise Violation("peer-end", f"{w.name}: room {room} ({r.rid}) still in {r.phase.name.lower()} "
                                            f"{now - due:.3f}s after its peer's notice that it ended arrived")

    def _check_progress(self, w: SimWorker) -> None:
        """no-starvation: the head of a worker's waiting queue, when the batch has room and
        the pages for its next chunk are free, is scheduled in the next iteration (FIFO);
        three iterations in a row without it is a stranded request."""
        sched = w.core.engine.scheduler
        if not sched.waiting:
            self._starving.pop(w.name, None)
            return
        head = sched.waiting[0]
        key = (head.rid, head.num_computed, len(head.pages), head.num_preemptions)
        was = self._starving.get(w.name)
        n = was[2] + 1 if was is not None and was[0] == key and was[1] else 0
        if n >= 3:
            raise Violation("no-starvation", f"{w.name}: {head.rid} heads the waiting queue for {n} iterations "
                                             f"with room in the batch and {sched.allocator.num_free} pages free")
        chunk = sched.chunk_of(head, sched.prefill_budget)
        need = pages_for(head.num_computed + chunk, sched.page_size) - len(head.pages)
        fits = len(sched.running) < sched.config.max_running_requests and need <= w.core.engine.allocator.num_free
        self._starving[w.name] = (key, fits, n)

    async def _watch_legs(self) -> None:
        try:
            await self._check_legs()
        except Violation as v:
            self.fail(v)

    async def _check_legs(self) -> None:
        cfg = self.router_cfg
        grace = cfg.health_interval / 4 + 0.05
        while True:
            await asyncio.sleep(0.05)
            now = self.clock.now()
            for routed in list(self.router.client._live.values()):
                att = routed.current
                if att is None or att._stopped:
                    continue
                for side, (url, task) in att.legs.items():
                    w = self.router.table.get(url)
                    if task.done() or side in att._final or side in att._dead or w.last_ok is None:
                        continue
                    if now > w.last_ok + cfg.health_lease + self._blind_since(w.last_ok, now) + grace:
                        raise Violation("leg-lease", f"{routed.rid}: its {side} leg on {url} is still open "
                                                     f"{now - w.last_ok - cfg.health_lease:.2f}s after the worker's "
                                                     "lease ended")

    def _blind_since(self, since: float, now: float) -> float:
        """Seconds after `since` the router could not look (its stalls, clock jumps)."""
        return sum(max(0.0, min(end, now) - max(start, since)) for start, end in self.blind)

    def _judged(self, judge: str, accused: str) -> None:
        """judge-stall: `judge` declared `accused` dead; some fault must have been able to
        silence it towards the judge within a few leases (stretched by the blind time)."""
        now = self.clock.now()
        lease = max(self.router_cfg.health_lease, self.lifecycle.heartbeat_interval * self.lifecycle.heartbeat_misses)
        since = now - self.t0 - 3 * lease - self._blind_since(float("-inf"), now)
        mine = {"freeze", "crash", "slow"} | ({"http_cut"} if judge == fl.ROUTER else set())
        links = {f"{judge}>{accused}", f"{accused}>{judge}"}
        for f in self.schedule:
            hit = (f.kind in mine and f.target == accused) or (f.kind in ("link", "partition") and f.target in links)
            if hit and f.at <= now - self.t0 and f.at + f.duration >= since:
                return
        raise Violation("judge-stall", f"{judge} declared {accused} dead with no fault on it or between them "
                                       f"(blind {self._blind_since(float('-inf'), now):.2f}s in all)")

    def _check_kv(self, w: SimWorker, req) -> None:
        tokens = req.prompt_ids + req.output_ids
        n = len(tokens) - 1 if req.output_ids else req.num_computed
        runner, h = w.core.engine.runner, bytes(8)
        for pos in range(n):
            h = chain(h, tokens[pos])
            if runner.read(req.pages, pos) != h:
                raise Violation("kv-intact", f"{w.name}: {req.rid} choice {req.index} position {pos} of {n} does not hold its "
                                             f"own KV (pages {req.pages})")

    def _check_debug_view(self, w: SimWorker) -> None:
        view = w.core.debug_view()["phases"]
        gauges = {s.labels["phase"]: s.value for m in self.metrics[w.name].registry.collect()
                  for s in m.samples if s.name == "kvrelay_requests"}
        if any(gauges.get(p, 0) != n for p, n in view.items()):
            raise Violation("debug-is-metrics", f"{w.name}: debug {view} != gauges {gauges}")

    # ---- the end -------------------------------------------------------------------------
    def _idle(self) -> bool:
        return (not self.router.client._live
                and all(w.state == "up" and not w.core.busy for w in self.workers))

    async def _settle(self) -> None:
        lc = self.lifecycle
        limit = self.clock.now() + lc.bootstrap_timeout + lc.transfer_timeout + lc.quarantine_grace \
            + 3 * lc.heartbeat_interval * lc.heartbeat_misses + 10.0
        while not self._idle():
            if self.clock.now() > limit:
                busy = {w.name: w.core.side.live() if w.core else w.state for w in self.workers}
                raise Violation("idle-whole", f"not idle long after the load: router {list(self.router.client._live)} "
                                              f"workers {busy}")
            await asyncio.sleep(SETTLE_POLL)
        await asyncio.sleep(1.0)   # late messages drain

    def _check_idle(self) -> None:
        for w in self.workers:
            try:
                w.core.check_idle()
            except AssertionError as e:
                raise Violation("idle-whole", f"{w.name}: {e}") from None
            self._check_debug_view(w)
        snap = self.router.client.snapshot()
        if any(snap.phases.values()):
            raise Violation("idle-whole", f"router phases {snap.phases}")


def run_seed(seed: int, cfg: SimConfig = SimConfig(), schedule: list[fl.Fault] | None = None) -> Result:
    logging.disable(logging.CRITICAL)
    # Sampled requests (max_n > 1) softmax tiny rows: on one thread, not an OpenMP team
    # (which, on a busy machine, waits milliseconds per op).
    threads = torch.get_num_threads()
    if cfg.max_n > 1:
        torch.set_num_threads(1)
    try:
        return Sim(seed, cfg, schedule).run()
    finally:
        logging.disable(logging.NOTSET)
        if cfg.max_n > 1:
            torch.set_num_threads(threads)

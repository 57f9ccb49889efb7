"""Real-process chaos with a seeded schedule: `make chaos`, or

    python tests/chaos.py --seeds 0-19 [--prefill 1 --decode 2] [--short]

One cluster of real `kvrelay prefill|decode|router` processes on a tiny random model
(short leases, the last decode worker with a small KV pool, one cluster key, so every
control message is signed and every worker call carries the token) serves one episode per seed
and is reused across them; a worker an episode killed is restarted. An episode, drawn
from `random.Random(seed)`: a load of mixed streaming and non-streaming greedy
completions (some clients leave mid-stream, some abort a plain request), and one or two
faults: SIGSTOP/SIGCONT of a worker below or above its lease, kill -9 and restart,
runtime faults through POST /debug/faults, a burst of long requests that saturates the
small decode pool (the clients and what they saw: chaos_load.py); and in some episodes
(a draw of its own) a stall of the router's loop (SIGSTOP/SIGCONT of the router, below or
above its lease of the workers). When the episode is idle, every invariant is checked
(`judge`, `leaks`, `fresh_request`; after a router stall with no worker fault, also that
the router declared no worker dead: a judge's stall is not a worker's fault). The table at the
end has one row per seed; a failing seed prints the command that replays it and the
script exits 1. Only real timing is not reproducible.

Without --prefill, seeds alternate between the two configurations: even seeds on
1 prefill + 2 decode, odd seeds on 2 prefill + 2 decode.
"""
from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvrelay.engine.core_share import host_cores

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_load import ALL_JOBS, JOBS, LONG_JOBS, Call, run_all, run_plain  # noqa: E402
from cluster_helpers import LEASE, ROUTER_LEASE, Cluster, Proc  # noqa: E402
from serving_helpers import gauge, metric_samples  # noqa: E402

# ---------------------------------------------------------------- bounds, in one place
HEARTBEAT = 0.5                      # --heartbeat-interval of LIFECYCLE_FLAGS; LEASE = 3 of them
SLACK = 2.5   # this shared 2-core machine: a busy step, a worker loading its model beside us
# Seconds from a fault's start until a client whose request sat on the faulty worker has
# its answer (the bounds). A request that had no token yet may instead be retried
# on another pair: it then also gets its own budget (`budget`) once more.
BOUND = {
    "stop-decode": ROUTER_LEASE + 2,   # router: health_interval * health_misses + 2 s
    "stop-prefill": LEASE + 2,         # P<->D lease + 2 s
    "kill": 3.0,                       # the leg's stream breaks at once
    "faults": 2 * (LEASE + 2 * HEARTBEAT) + 2,   # two tries, each ended by the P<->D lease
    "saturate": 0.0,                   # only queueing: the burst's own budget covers it
}
# A failed one-sided write that never confirms it stopped keeps D's pages in quarantine
# until --transfer-timeout + --quarantine-grace (1 s). The workers' --transfer-timeout is
# lowered from LIFECYCLE_FLAGS' 60 s to keep such episodes short, but stays above every
# client bound, so a request that only this backstop ended is still a violation.
TRANSFER_TIMEOUT = 20.0
QUARANTINE = TRANSFER_TIMEOUT + 1 + SLACK
SMALL_POOL = "1024"                  # --max-kv-tokens of the last decode worker (64 pages)
SHORT_STOP = (0.2, 1.0)              # below the lease: requests only pause
LONG_STOP = (BOUND["stop-decode"] + SLACK + 1, BOUND["stop-decode"] + SLACK + 3)
# The router's own stalls: seen (above half a health interval), below and above its lease.
STALLS = ((1.0, 2.0), (ROUTER_LEASE + 1, ROUTER_LEASE + 3))
ROUTER = "router"


def budget(prompt_tokens: int, max_tokens: int) -> float:
    """A fault-free request's answer time, generous for this machine under the episode's load."""
    return 3.0 + 0.012 * max_tokens + 0.005 * prompt_tokens


# ---------------------------------------------------------------- the faults
SPECS_ANY = ("drop_ctrl=0.3", "delay_ctrl=0.2", "dup_ctrl=0.5", "reorder_ctrl=0.5", "drop_heartbeat=1")
SPECS = {"prefill": SPECS_ANY + ("hang_transfer=1", "fail_transfer=0.5", "drop:Aux=1", "drop:BootstrapInfo=1"),
         "decode": SPECS_ANY + ("ignore_aux=1", "drop_ack=1", "drop:Destination=1")}


@dataclass
class Fault:
    kind: str            # stop | kill | faults | saturate | stall
    worker: str          # a Proc name ("" for saturate: the burst goes through the router; ROUTER for stall)
    at: float
    duration: float = 0.0
    spec: str = ""
    t0: float = 0.0      # when it began (monotonic)
    ended: float = 0.0   # when its effect ended (SIGCONT, spec cleared, worker healthy again)
    on_worker: dict[str, str] = field(default_factory=dict)   # router rid -> its phase at t0

    def label(self) -> str:
        if self.kind == "stall":
            return f"stall router {self.duration:.1f}s"
        if self.kind == "stop":
            return f"stop {self.worker} {self.duration:.1f}s"
        if self.kind == "faults":
            return f"{self.worker} {self.spec} {self.duration:.1f}s"
        return f"kill {self.worker}" if self.kind == "kill" else "saturate"

    def bound_key(self, role: str) -> str:
        return f"stop-{role}" if self.kind == "stop" else self.kind

    @property
    def sharp(self) -> bool:
        """Does it end the requests on its worker within BOUND (rather than only delay them)?"""
        return self.kind == "kill" or (self.kind == "stop" and self.duration >= SHORT_STOP[1] + 0.5)


@dataclass
class Episode:
    seed: int
    calls: list[Call]
    faults: list[Fault]


def draw_episode(seed: int, workers: list[str], short: bool) -> Episode:
    """The whole schedule, from the seed alone."""
    rng = random.Random(seed)
    n = rng.randint(5, 7) if short else rng.randint(8, 13)
    kinds = rng.choices(("stream", "plain", "leave", "abort"), weights=(4, 4, 1, 1), k=n)
    calls = [Call(rng.randrange(len(JOBS)), k, round(rng.uniform(0.0, 3.0), 2)) for k in kinds]
    for c in calls:
        c.leave_after = rng.randint(1, 120) if c.kind == "leave" else round(rng.uniform(0.2, 1.5), 2) \
            if c.kind == "abort" else 0.0
    faults = []
    for name in rng.sample(workers, 1 if short else rng.choice((1, 2))):
        kind = rng.choices(("stop", "kill", "faults", "saturate"), weights=(4, 2, 3, 1))[0]
        f = Fault(kind, name, round(rng.uniform(0.5, 2.5), 2))
        if kind == "stop":
            f.duration = round(rng.uniform(*(SHORT_STOP if rng.random() < 0.4 else LONG_STOP)), 2)
        elif kind == "faults":
            f.spec = rng.choice(SPECS[name.split("-")[0]]) + f";seed={seed}"
            f.duration = round(rng.uniform(1.0, 3.0), 2)
        elif kind == "saturate":
            f.worker = ""
            calls += [Call(len(JOBS) + rng.randrange(len(LONG_JOBS)), rng.choice(("stream", "plain")), f.at)
                      for _ in range(4)]
        faults.append(f)
    stalls = random.Random(seed ^ 0x57A11)   # a stream of its own: the draws above stay what they were
    if stalls.random() < 0.3:
        span = STALLS[stalls.random() < 0.5]
        faults.append(Fault("stall", ROUTER, round(stalls.uniform(0.5, 2.5), 2), round(stalls.uniform(*span), 2)))
    return Episode(seed, calls, faults)


def apply_fault(cluster: Cluster, f: Fault, t_zero: float) -> None:
    time.sleep(max(0.0, t_zero + f.at - time.monotonic()))
    if f.kind == "saturate":
        f.t0 = f.ended = time.monotonic()
        return
    proc = cluster.router if f.kind == "stall" else proc_named(cluster, f.worker)
    f.on_worker = {} if f.kind == "stall" else rows_on(cluster, proc)
    f.t0 = time.monotonic()
    try:
        if f.kind in ("stop", "stall"):
            proc.signal(signal.SIGSTOP)
            time.sleep(f.duration)
            proc.signal(signal.SIGCONT)
        elif f.kind == "kill":
            proc.signal(signal.SIGKILL)
            proc.popen.wait()
            time.sleep(1.0)
            proc.start().wait_healthy()
        else:
            cluster.set_faults([proc], f.spec)
            time.sleep(f.duration)
            cluster.set_faults([proc], "")
    finally:   # `Harness.heal` undoes whatever an exception left behind
        f.ended = time.monotonic()


def proc_named(cluster: Cluster, name: str) -> Proc:
    return next(p for p in cluster.workers if p.name == name)


def rows_on(cluster: Cluster, proc: Proc) -> dict[str, str]:
    """The router's live requests with a leg on `proc`, and their phase (router rows only:
    asking the workers would wait on the one a fault already froze)."""
    rows = httpx.get(f"{cluster.url}/debug/requests", timeout=10).json()["requests"]
    return {r["id"]: r["phase"] for r in rows if proc.url in (r["prefill"], r["decode"])}


# ---------------------------------------------------------------- the checks
def judge(ep: Episode, refs: dict[int, str], role_of: dict[str, str]) -> float:
    """Adds each client's problems; returns the worst answer (time taken, time allowed),
    the one nearest its bound."""
    worst = (0.0, 1.0)
    for c in ep.calls:
        job = ALL_JOBS[c.job]
        own = budget(job.prompt_tokens, job.max_tokens)
        if c.t_end is None:
            c.problems.append("client never ended")
            continue
        if c.outcome == "ok" and c.text != refs[c.job]:
            c.problems.append(f"text differs from the fault-free run: {c.text[:60]!r} vs {refs[c.job][:60]!r}")
        if not c.owed:
            continue
        bounds = [c.t_start + own + sum(_extra(f, role_of, own) for f in ep.faults if _overlaps(f, c))]
        for f in ep.faults:
            phase = f.on_worker.get(c.rid or "")
            if f.sharp and phase is not None:
                sharp = f.t0 + BOUND[f.bound_key(role_of[f.worker])] + SLACK
                # A request answered ok after the fault hit its worker was retried on another
                # pair (it had no token yet), whatever phase it was in: its own budget again.
                retried = phase == "dispatched" or c.outcome == "ok"
                bounds.append(sharp + (own if retried else 0.0))
        bound = c.bound = min(bounds)
        took, allowed = c.t_end - c.t_start, bound - c.t_start
        worst = max(worst, (took, allowed), key=lambda w: w[0] / w[1])
        if c.t_end > bound:
            c.problems.append(f"answered after {took:.1f} s, bound {allowed:.1f} s ({c.outcome})")
    return worst


def describe(c: Call, t_zero: float) -> str:
    took = f"{c.t_end - c.t_start:5.2f}" if c.t_end is not None else "  -  "
    return (f"{c.kind:6} job {c.job} at {c.t_start - t_zero:5.2f} took {took} s bound {c.bound - c.t_start:5.2f} "
            f"{c.outcome:18} {c.rid or ''} {'; '.join(c.problems)}")


def _overlaps(f: Fault, c: Call) -> bool:
    end = f.ended if f.kind != "saturate" else f.t0 + 1.0
    return f.t0 < c.t_end and end > c.t_start


def _extra(f: Fault, role_of: dict[str, str], own: float) -> float:
    """What one overlapping fault may add to a request's answer time: its bound (a short
    stop: its length), plus one retry of the request (saturate: the queue ahead of it)."""
    if f.kind == "saturate":
        return sum(budget(j.prompt_tokens, j.max_tokens) for j in LONG_JOBS)
    if f.kind == "stall":   # everything waits for the router, then goes on
        return f.duration + SLACK + own
    if f.kind == "stop" and not f.sharp:
        return f.duration + own
    if f.kind == "faults":
        return f.duration + BOUND["faults"] + own
    return BOUND[f.bound_key(role_of[f.worker])] + SLACK + own


def leaks(cluster: Cluster, timeout: float = 10.0) -> list[str]:
    """Waits up to `timeout` s for idle; what still is not: phase gauges, pages, /debug/requests.
    Pages in quarantine (a failed one-sided write that never confirmed it stopped) are
    held on purpose until --transfer-timeout + --quarantine-grace: waited for that long."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        bad, quarantined = idle_problems(cluster)
        if quarantined and not bad:
            deadline = start + QUARANTINE
        if not bad and not quarantined or time.monotonic() > deadline:
            return bad + [f"{n} pages still quarantined" for n in quarantined]
        time.sleep(0.25)


def idle_problems(cluster: Cluster) -> tuple[list[str], list[str]]:
    bad, quarantined = [], []
    for p in [cluster.router, *cluster.workers]:
        s = metric_samples(p.url)
        phases = {dict(ls)["phase"]: v for (n, ls), v in s.items() if n == "kvrelay_requests" and v}
        free, total = gauge(s, "kvrelay_kv_pages_free"), gauge(s, "kvrelay_kv_pages_capacity")
        held = sum(gauge(s, "kvrelay_kv_pages_quarantined"))
        if phases:
            bad.append(f"{p.name} phases {phases}")
        if held:
            quarantined.append(f"{p.name}: {held:g}")
        elif free != total or (p is not cluster.router and not total):   # the router has no pool
            bad.append(f"{p.name} free pages {free} of {total}")
    view = httpx.get(f"{cluster.url}/debug/requests", timeout=10).json()
    if view["count"]:
        bad.append(f"router lists {view['count']} requests")
    for url, w in view["workers"].items():
        if w.get("error") or w.get("requests"):
            bad.append(f"{url} /debug/requests: {w.get('error') or len(w['requests'])}")
    return bad, quarantined


def router_counter(cluster: Cluster, name: str) -> float:
    return sum(gauge(metric_samples(cluster.url), name))


def stall_problems(ep: Episode, before: dict[str, float], cluster: Cluster) -> list[str]:
    """After a router stall in an episode that harmed no worker: the router saw its stall,
    and declared no worker dead for it."""
    stalls = [f for f in ep.faults if f.kind == "stall"]
    if not stalls:
        return []
    after = {name: router_counter(cluster, name) for name in before}
    problems = []
    if after["kvrelay_router_loop_stalls_total"] <= before["kvrelay_router_loop_stalls_total"]:
        problems.append(f"the router did not see its own stall ({stalls[0].label()})")
    harmed = any(f.kind in ("stop", "kill") for f in ep.faults)
    gone = after["kvrelay_router_lease_expiries_total"] - before["kvrelay_router_lease_expiries_total"]
    if gone and not harmed:
        problems.append(f"the router declared {gone:g} worker(s) dead for its own stall ({stalls[0].label()})")
    return problems


def fresh_request(cluster: Cluster, refs: dict[int, str]) -> str | None:
    """A problem, or None when a new request after the episode succeeds with its reference text."""
    call = Call(0, "plain", 0.0)
    call.t_start = time.monotonic()
    run_plain(cluster.url, call, JOBS[0])
    if call.outcome != "ok":
        return f"fresh request: {call.outcome} {call.problems}"
    return None if call.text == refs[0] else f"fresh request: text {call.text!r} vs {refs[0]!r}"


# ---------------------------------------------------------------- cluster and episodes
class Harness:
    """One cluster of a configuration, its references, and the episodes run on it."""

    def __init__(self, model_dir: Path, num_prefill: int, num_decode: int, router_flags: list[str] = (),
                 worker_flags: list[str] = (), share_cores: bool = False) -> None:
        self.model_dir, self.num_prefill, self.num_decode = model_dir, num_prefill, num_decode
        self.router_flags, self.worker_flags = list(router_flags), list(worker_flags)
        self.share_cores = share_cores
        self.cluster: Cluster | None = None
        self.refs: dict[int, str] = {}

    @property
    def config(self) -> str:
        return f"{self.num_prefill}P+{self.num_decode}D"

    def start(self) -> None:
        c = Cluster(["--model", f"random:{self.model_dir}"], ["--dtype", "float32", "--max-kv-tokens", "16384"],
                    num_prefill=self.num_prefill, num_decode=self.num_decode, keyed=True)
        c.decode[-1].argv += ["--max-kv-tokens", SMALL_POOL]   # argparse: the last value wins
        for i, p in enumerate(c.workers):
            p.argv += ["--transfer-timeout", str(TRANSFER_TIMEOUT), *self.worker_flags]
            if self.share_cores:   # as `kvrelay serve` runs them: every core, each taking its part per step
                p.argv += ["--core-share", f"{c.dir}/cores:{i}"]
                p.env["OMP_NUM_THREADS"] = str(host_cores())
        c.router.argv += ["--request-timeout", "60", *self.router_flags]
        self.cluster = c.start()
        self.refs = self.references()

    def stop(self, keep_logs: bool = False) -> None:
        if self.cluster is not None:
            self.cluster.stop(keep_logs)
            self.cluster = None

    def references(self) -> dict[int, str]:
        """Every job's text without faults, twice (plain, then streamed, all at once): they
        must agree, or no comparison later would mean anything."""
        runs = []
        for kind in ("plain", "stream"):
            calls = [Call(j, kind, 0.0) for j in range(len(ALL_JOBS))]
            run_all(self.cluster.url, calls)
            bad = [(c.job, c.outcome, c.problems) for c in calls if c.outcome != "ok"]
            if bad:
                raise RuntimeError(f"fault-free reference run failed: {bad}\n{self.cluster.logs()}")
            runs.append({c.job: c.text for c in calls})
        if runs[0] != runs[1]:
            diff = [j for j in runs[0] if runs[0][j] != runs[1][j]]
            raise RuntimeError(f"greedy text differs between two fault-free runs for jobs {diff}")
        return runs[0]

    def episode(self, seed: int, short: bool) -> dict:
        c = self.cluster
        role_of = {p.name: p.name.split("-")[0] for p in c.workers}
        ep = draw_episode(seed, sorted(role_of), short)
        counters = {name: router_counter(c, name) for name in ("kvrelay_router_loop_stalls_total",
                                                               "kvrelay_router_lease_expiries_total")}
        t_zero = time.monotonic() + 0.2
        threads = [threading.Thread(target=apply_fault, args=(c, f, t_zero), daemon=True) for f in ep.faults]
        for t in threads:
            t.start()
        run_all(c.url, ep.calls, t_zero)
        for t in threads:
            t.join(180)
        self.heal()
        worst = judge(ep, self.refs, role_of)
        problems = [f"client {i} ({call.kind} job {call.job}): {p}" for i, call in enumerate(ep.calls)
                    for p in call.problems]
        problems += stall_problems(ep, counters, c)
        leaked = leaks(c)
        problems += [f"leak: {x}" for x in leaked]
        if not leaked and (fresh := fresh_request(c, self.refs)) is not None:
            problems.append(fresh)
        return {"seed": seed, "config": self.config, "faults": [f.label() for f in ep.faults],
                "hit": sum(len(f.on_worker) for f in ep.faults), "requests": len(ep.calls),
                "outcomes": Counter(x.outcome for x in ep.calls), "worst": worst, "leaks": leaked,
                "problems": problems, "clients": [describe(x, t_zero) for x in ep.calls],
                "wall": time.monotonic() - t_zero}

    def heal(self) -> None:
        """Every worker running, unfrozen, fault-free, and seen up by the router."""
        c = self.cluster
        c.router.signal(signal.SIGCONT)
        for p in c.workers:
            if p.popen is None or p.popen.poll() is not None:
                p.start().wait_healthy()
            p.signal(signal.SIGCONT)
        c.set_faults(c.workers, "")
        c.wait_router_sees_all()


def tiny_model_dir() -> Path:
    from kvrelay.engine.models.testing import make_tiny_model_dir

    return make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="kvrelay-chaos-")) / "tiny-llama", arch="llama", seed=0)


@dataclass(frozen=True)
class Options:
    short: bool = False                 # fewer requests, one fault per episode
    router_flags: tuple[str, ...] = ()  # extra router flags (last wins), e.g. to try other leases
    worker_flags: tuple[str, ...] = ()  # extra flags of every worker (last wins), e.g. --transfer-timeout
    verbose: bool = False               # print every client of every episode
    share_cores: bool = False           # the workers share the host's cores (--core-share), as under serve

    def replay(self, result: dict) -> str:
        p, d = result["config"].rstrip("D").split("P+")
        flags = f" --router-flags='{' '.join(self.router_flags)}'" if self.router_flags else ""
        flags += f" --worker-flags='{' '.join(self.worker_flags)}'" if self.worker_flags else ""
        flags += " --share-cores" if self.share_cores else ""
        return (f".venv/bin/python tests/chaos.py --seeds {result['seed']} --prefill {p} --decode {d}"
                + (" --short" if self.short else "") + flags)


def run_seeds(seeds: list[int], configs: dict[int, tuple[int, int]], opts: Options = Options(),
              model_dir: Path | None = None, log=print) -> list[dict]:
    """One episode per seed on the configuration `configs[seed]` (num_prefill, num_decode);
    one cluster per configuration, restarted after an episode that found a problem (so
    that the next seeds are judged on a clean cluster)."""
    model_dir = model_dir or tiny_model_dir()
    results = []
    for config in dict.fromkeys(configs[s] for s in seeds):
        h = Harness(model_dir, *config, router_flags=opts.router_flags, worker_flags=opts.worker_flags,
                    share_cores=opts.share_cores)
        try:
            for seed in (s for s in seeds if configs[s] == config):
                if h.cluster is None:
                    t = time.monotonic()
                    h.start()
                    log(f"cluster {h.config} up with references in {time.monotonic() - t:.1f} s; "
                        f"logs in {h.cluster.dir}")
                try:
                    result = h.episode(seed, opts.short)
                except Exception as exc:   # the cluster itself broke: this seed failed
                    result = {"seed": seed, "config": h.config, "faults": [], "hit": 0, "requests": 0,
                              "outcomes": Counter(), "worst": (0.0, 1.0), "leaks": [], "wall": 0.0,
                              "clients": [], "problems": [f"harness: {type(exc).__name__}: {exc}"]}
                results.append(result)
                log(f"seed {seed} {h.config}: {'; '.join(result['faults'])}: "
                    f"{'FAIL' if result['problems'] else 'ok'} in {result['wall']:.1f} s")
                if opts.verbose:
                    log("\n".join(f"  {line}" for line in result["clients"]))
                if result["problems"]:
                    result["logs"] = str(h.cluster.dir)
                    h.stop(keep_logs=True)
        finally:
            h.stop()
    return results


def print_table(results: list[dict], wall: float, opts: Options) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvrelay chaos: {len(results)} episodes in {wall:.0f} s")
    for col in ("seed", "cluster", "faults applied", "requests", "hit", "outcomes", "worst / bound", "leaks",
                "result"):
        table.add_column(col)
    for r in results:
        outcomes = " ".join(f"{k}:{v}" for k, v in sorted(r["outcomes"].items()))
        table.add_row(str(r["seed"]), r["config"], "\n".join(r["faults"]), str(r["requests"]), str(r["hit"]),
                      outcomes, "{:.1f} / {:.1f} s".format(*r["worst"]), "; ".join(r["leaks"]) or "none",
                      "[red]FAIL[/red]" if r["problems"] else "ok")
    console = Console(width=max(Console().width, 150))
    console.print(table)
    for r in results:
        if r["problems"]:
            console.print(f"[red]seed {r['seed']} ({r['config']}) failed[/red]; logs in {r.get('logs')}; "
                          f"replay: {opts.replay(r)}", highlight=False)
            for p in r["problems"]:
                console.print(f"  {p}", highlight=False, markup=False)


def parse_seeds(text: str) -> list[int]:
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += range(int(lo), int(hi or lo) + 1)
    return seeds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-19", help="e.g. 0-19 or 3,7,11")
    ap.add_argument("--prefill", type=int, help="prefill workers (default: even seeds 1, odd seeds 2)")
    ap.add_argument("--decode", type=int, default=2, help="decode workers (the last has a small KV pool)")
    ap.add_argument("--short", action="store_true", help="smaller episodes: fewer requests, one fault")
    ap.add_argument("--router-flags", default="", help="extra router flags, e.g. '--health-misses 100'")
    ap.add_argument("--worker-flags", default="", help="extra worker flags, e.g. '--transfer-timeout 8'")
    ap.add_argument("--share-cores", action="store_true",
                    help="the workers share the host's cores (--core-share), as `kvrelay serve` runs them")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every client of every episode")
    args = ap.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    configs = {s: (args.prefill or 1 + s % 2, args.decode) for s in seeds}
    opts = Options(args.short, tuple(args.router_flags.split()), tuple(args.worker_flags.split()), args.verbose,
                   args.share_cores)
    t = time.monotonic()
    results = run_seeds(seeds, configs, opts)
    print_table(results, time.monotonic() - t, opts)
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

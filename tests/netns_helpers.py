"""Network faults between hosts, on one machine: two network namespaces (P and D) joined by
a veth pair that carries only P<->D traffic, each also joined to the root namespace by its
own veth for router<->worker HTTP. Faults go on the P<->D link only:

    root ns (router) --rp-- [ns P] ==pd== [ns D] --rd-- root ns
                     10.77.N.0/30   10.77.N.4/30   10.77.N.8/30

Faults: loss (iptables `statistic`), one-way drop, partition (both ways), a bandwidth
limit (tc tbf) and delay (tc netem, only where the kernel has it); and a bandwidth limit
on a router<->worker link (`limit_router_link`). Every address used is
inside these /30 links or 127.0.0.1. Names carry the test process's pid and a counter,
and N is a third octet no interface of the root namespace uses yet, so parallel or
leftover runs do not collide; `Netns.remove()` is idempotent.

Needs root, `ip` with netns support, `tc` and `iptables`; `missing()` names what is
absent so a test can skip with one line saying why.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from cluster_helpers import Cluster, Proc

PREFIX = "kvr"  # namespace and interface names start with it (cleanup of leftovers)
_made = 0       # Netns objects made by this process: part of their names


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def missing() -> str | None:
    """Why namespace tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespace tests need root"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"network namespace tests need `{tool}` (not installed)"
    probe = f"{PREFIX}probe{os.getpid()}"
    r = sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    try:
        r = sh("ip", "netns", "exec", probe, "iptables", "-L", "-n", check=False)
        if r.returncode != 0:
            return f"iptables does not work in a namespace: {r.stderr.strip().splitlines()[-1:]}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None


def has_netem() -> bool:
    """tc netem exists only where the kernel has sch_netem."""
    probe = f"{PREFIX}nem{os.getpid()}"
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        sh("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up", check=False)
        r = sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
               check=False)
        return r.returncode == 0
    finally:
        sh("ip", "netns", "del", probe, check=False)


def remove_leftovers() -> None:
    """Namespaces of earlier runs whose process is gone (a killed test never cleaned up)."""
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(PREFIX) + 1:].split("x")[0]
        if name.startswith(PREFIX) and pid.isdigit():
            pid = int(pid)
            if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
                sh("ip", "netns", "del", name, check=False)


def _free_octet() -> int:
    """A third octet N such that no root-namespace address lies in 10.77.N.0/24."""
    used = sh("ip", "-4", "-o", "addr", "show", check=False).stdout
    for n in range(os.getpid() % 200, os.getpid() % 200 + 250):
        if f" 10.77.{n % 250}." not in used:
            return n % 250
    raise RuntimeError("no free 10.77.N.0/24 for the test namespaces")


class Netns:
    """The two namespaces and three links of one test run."""

    def __init__(self) -> None:
        global _made
        _made += 1
        tag = f"{os.getpid()}x{_made}"   # at most 7 + 1 + 2 characters: names stay within 15
        self.ns = {"P": f"{PREFIX}p{tag}", "D": f"{PREFIX}d{tag}"}
        net = f"10.77.{_free_octet()}"
        # P<->D link (the one faults go on), and each namespace's link to the root namespace.
        self.pd = {"P": (f"{PREFIX}pd{tag}", f"{net}.5"), "D": (f"{PREFIX}dp{tag}", f"{net}.6")}
        self.root = {"P": (f"{PREFIX}rp{tag}", f"{net}.1"), "D": (f"{PREFIX}rd{tag}", f"{net}.9")}
        self.inner = {"P": (f"{PREFIX}ip{tag}", f"{net}.2"), "D": (f"{PREFIX}id{tag}", f"{net}.10")}
        self.created = False

    # ---- addresses ----------------------------------------------------------------------------
    def transfer_host(self, side: str) -> str:
        """Where the side's transfer endpoint binds: its end of the P<->D link."""
        return self.pd[side][1]

    def http_host(self, side: str) -> str:
        """Where the side's HTTP server listens: its end of the link to the root namespace."""
        return self.inner[side][1]

    def ucx_env(self, side: str) -> dict[str, str]:
        """UCX (nixl) on the P<->D link only: its tcp transport on that interface. Without
        this, UCX between two processes of one machine uses shared memory or CMA, which no
        network fault touches."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.pd[side][0]}

    def exec_prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def in_ns(self, side: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh(*self.exec_prefix(side), *argv, check=check)

    # ---- topology --------------------------------------------------------------------------------
    def create(self) -> "Netns":
        remove_leftovers()
        self.remove()
        self.created = True
        for side, ns in self.ns.items():
            sh("ip", "netns", "add", ns)
            self.in_ns(side, "ip", "link", "set", "lo", "up")
        self._veth(self.pd["P"], ("P",), self.pd["D"], ("D",))
        for side in ("P", "D"):
            self._veth(self.root[side], (), self.inner[side], (side,))
        return self

    def _veth(self, a: tuple[str, str], a_ns: tuple[str, ...], b: tuple[str, str], b_ns: tuple[str, ...]) -> None:
        """A veth pair a<->b, each end in its namespace (root if none), with its /30 address."""
        sh("ip", "link", "add", a[0], "type", "veth", "peer", "name", b[0])
        for (name, addr), where in ((a, a_ns), (b, b_ns)):
            prefix = self.exec_prefix(where[0]) if where else []
            if where:
                sh("ip", "link", "set", name, "netns", self.ns[where[0]])
            sh(*prefix, "ip", "addr", "add", f"{addr}/30", "dev", name)
            sh(*prefix, "ip", "link", "set", name, "up")

    def remove(self) -> None:
        """Delete both namespaces (their veth ends go with them, and so do the peers in the
        root namespace). Processes inside must be stopped first."""
        for ns in self.ns.values():
            sh("ip", "netns", "del", ns, check=False)
        for name, _ in self.root.values():
            sh("ip", "link", "del", name, check=False)
        self.created = False

    # ---- faults on the P<->D link ----------------------------------------------------------------
    def _drop(self, side: str, chain: str, probability: float | None) -> None:
        dev = self.pd[side][0]
        flag = "-i" if chain == "INPUT" else "-o"
        rule = [chain, flag, dev]
        if probability is not None:
            rule += ["-m", "statistic", "--mode", "random", "--probability", f"{probability:.4f}"]
        self.in_ns(side, "iptables", "-w", "-A", *rule, "-j", "DROP")

    def loss(self, probability: float) -> None:
        """Drop each packet on the P<->D link with `probability`, both ways (on arrival)."""
        for side in ("P", "D"):
            self._drop(side, "INPUT", probability)

    def drop_one_way(self, src: str) -> None:
        """Everything `src` ("P" or "D") sends on the P<->D link is dropped; the other
        direction still flows."""
        self._drop(src, "OUTPUT", None)

    def partition(self) -> None:
        """Nothing crosses the P<->D link, either way."""
        for side in ("P", "D"):
            self._drop(side, "OUTPUT", None)
            self._drop(side, "INPUT", None)

    def limit_rate(self, rate: str = "2mbit") -> None:
        """A token bucket on both ends of the P<->D link: each direction at most `rate`."""
        for side in ("P", "D"):
            self.in_ns(side, "tc", "qdisc", "replace", "dev", self.pd[side][0], "root", "tbf",
                       "rate", rate, "burst", "32kbit", "latency", "400ms")

    def limit_router_link(self, side: str, rate: str, queue: str) -> None:
        """A token bucket on the link between the root namespace (the router) and `side`,
        both ways: at most `rate`, with up to `queue` of bytes waiting."""
        for dev, prefix in ((self.root[side][0], []), (self.inner[side][0], self.exec_prefix(side))):
            sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kbit",
               "latency", queue)

    def delay(self, ms: float) -> None:
        """netem delay on both ends of the P<->D link (check has_netem() first)."""
        for side in ("P", "D"):
            self.in_ns(side, "tc", "qdisc", "replace", "dev", self.pd[side][0], "root", "netem",
                       "delay", f"{ms}ms")

    def heal(self) -> None:
        """Remove every fault: iptables rules flushed, qdiscs back to the default."""
        for side in ("P", "D"):
            self.in_ns(side, "iptables", "-w", "-F")
            self.in_ns(side, "tc", "qdisc", "del", "dev", self.pd[side][0], "root", check=False)
            self.in_ns(side, "tc", "qdisc", "del", "dev", self.inner[side][0], "root", check=False)
            sh("tc", "qdisc", "del", "dev", self.root[side][0], "root", check=False)


# ---- workers inside the namespaces ---------------------------------------------------------------

class NsProc(Proc):
    """A `kvrelay` worker run with `ip netns exec NS`, its HTTP server on `host`."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir, prefix: list[str], host: str,
                 env: dict | None = None) -> None:
        super().__init__(name, [*argv, "--host", host], port, log_dir)
        self.prefix, self.host = prefix, host
        self.env.update(env or {})

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "NsProc":
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
                   UCX_MODULES="^ib", **self.env)
        with open(self.log, "ab") as out:
            # `ip netns exec` execs the command: the Popen's pid is the worker's.
            self.popen = subprocess.Popen([*self.prefix, sys.executable, "-m", "kvrelay", *self.argv,
                                           "--port", str(self.port)],
                                          stdout=out, stderr=subprocess.STDOUT, env=env)
        return self


class NetnsCluster(Cluster):
    """One prefill worker in namespace P, one decode worker in namespace D, the router in
    the root namespace; the transfer endpoints bind on the P<->D link. With nixl, UCX is
    kept on that link too (`Netns.ucx_env`): its tcp transport on the P<->D interface, no
    shared-memory shortcut between the two processes of this one machine. Workers off
    loopback need the cluster key, so the cluster is always keyed."""

    def __init__(self, net: Netns, model_args: list[str], worker_args: list[str] = (), backend: str = "tcp",
                 router_args: list[str] = ()) -> None:
        super().__init__(model_args, worker_args, num_prefill=1, num_decode=1, backend=backend, keyed=True)
        self.net = net

        def ns_proc(old: Proc, side: str) -> NsProc:
            # Not on loopback: no fault injection (the netns faults are the network's own).
            argv = [a for a in old.argv if a != "--enable-fault-injection"] + ["--transfer-host", net.transfer_host(side)]
            env = net.ucx_env(side) if backend == "nixl" else None
            return NsProc(old.name, argv, old.port, self.dir, net.exec_prefix(side), net.http_host(side), env)

        prefill, decode = ns_proc(self.prefill[0], "P"), ns_proc(self.decode[0], "D")
        moved = {self.prefill[0].url: prefill.url, self.decode[0].url: decode.url}
        self.prefill, self.decode = [prefill], [decode]
        # The router keeps Cluster's flags (health lease, timeouts); only the worker URLs change.
        router = [moved.get(a, a) for a in self.router.argv] + list(router_args)
        self.router = Proc("router", router, self.router.port, self.dir)

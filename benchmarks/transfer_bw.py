"""KV transfer latency and bandwidth: each backend next to the plain baseline it must approach.

    .venv/bin/python benchmarks/transfer_bw.py [--backends shm,tcp,nixl] [--quick] [--auth]

--auth adds each backend with a cluster key (every frame sealed, as in a keyed cluster) as
a third case, measured in the same interleaved rounds: its ratio to the baseline is the
cost of authentication.

Baselines (no kvrelay code): a memcpy into a shared-memory segment, a pyzmq send/recv over
tcp loopback (zero-copy send, receiver copies the frame into its destination buffer), and
a NIXL UCX WRITE between two DRAM agents. Every timing is a median of repeated runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from multiprocessing import shared_memory
from typing import Callable

os.environ.setdefault("UCX_MODULES", "^ib")  # must precede any UCX load, or exit segfaults
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KIB, MIB = 1 << 10, 1 << 20
LATENCY_SIZE = 4 * KIB
SIZES = (1 * MIB, 16 * MIB, 256 * MIB)
# A case is built for one size: it returns (run_once, cleanup); run_once moves `size` bytes
# and returns when the sender knows they landed, optionally with its own timing (seconds)
# when set-up it must not count (a room's rendezvous) happens inside it.
Case = Callable[[int], "tuple[Callable[[], float | None], Callable[[], None]]"]


def reps_for(size: int, quick: bool) -> int:
    if size <= LATENCY_SIZE:
        return 50 if quick else 300
    n = 11 if size >= 256 * MIB else 60 if size >= 16 * MIB else 100
    return max(2, n // 3) if quick else n


def median_seconds(cases: list[Case], size: int, quick: bool) -> list[float]:
    """Median time of each case at `size`. The cases' repetitions are interleaved, so a
    burst of load from another process hits a baseline and its backend alike."""
    built = [case(size) for case in cases]
    try:
        times: list[list[float]] = [[] for _ in built]
        for rep in range(reps_for(size, quick) + 1):
            for (run_once, _), samples in zip(built, times):
                t = time.perf_counter()
                own = run_once()
                if rep:  # rep 0 warms up: first touch of pages, connection set-up
                    samples.append(time.perf_counter() - t if own is None else own)
        return [statistics.median(t) for t in times]
    finally:
        for _, cleanup in built:
            cleanup()


def filled(size: int) -> bytearray:
    return bytearray(os.urandom(4096) * (size // 4096)) + bytearray(size % 4096)


# ---- baselines ---------------------------------------------------------------------------

def memcpy_shm_case(size: int):
    seg = shared_memory.SharedMemory(create=True, size=size)
    src = memoryview(filled(size))

    def run_once() -> None:
        seg.buf[:size] = src

    def cleanup() -> None:
        seg.close()
        seg.unlink()
    return run_once, cleanup


def pyzmq_case(size: int):
    import zmq
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PAIR)
    port = recv.bind_to_random_port("tcp://127.0.0.1")
    send = ctx.socket(zmq.PAIR)
    send.connect(f"tcp://127.0.0.1:{port}")
    src, dst = memoryview(filled(size)), memoryview(bytearray(size))

    def run_once() -> None:
        send.send(src, copy=False)
        frame = recv.recv(copy=False)
        dst[:] = frame.buffer
        recv.send(b"ack")
        send.recv()

    def cleanup() -> None:
        send.close(linger=0)
        recv.close(linger=0)
        ctx.term()
    return run_once, cleanup


def anon_buffer(size: int):
    """Private anonymous memory on transparent huge pages (what the nixl backend registers),
    so the baseline and the backend copy between the same kind of memory."""
    import ctypes
    import mmap
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mem.madvise(mmap.MADV_HUGEPAGE)
    return mem, ctypes.addressof(ctypes.c_char.from_buffer(mem))


def nixl_case(size: int):
    import logging

    from nixl._api import nixl_agent, nixl_agent_config
    logging.getLogger("nixl").setLevel(logging.WARNING)
    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent(f"bench-a-{size}", cfg), nixl_agent(f"bench-b-{size}", cfg)
    (src, src_addr), (dst, dst_addr) = anon_buffer(size), anon_buffer(size)
    src[:] = filled(size)
    reg_a = a.register_memory([(src_addr, size, 0, "")], "DRAM")
    reg_b = b.register_memory([(dst_addr, size, 0, "")], "DRAM")
    buffers = [src, dst]
    remote = a.add_remote_agent(b.get_agent_metadata())
    local_descs = a.get_xfer_descs([(src_addr, size, 0)], "DRAM")
    remote_descs = a.get_xfer_descs([(dst_addr, size, 0)], "DRAM")

    def run_once() -> None:
        handle = a.initialize_xfer("WRITE", local_descs, remote_descs, remote)
        state = a.transfer(handle)
        while state == "PROC":  # no progress threads: both agents are pumped here
            state = a.check_xfer_state(handle)
            b.get_new_notifs()
        a.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL write ended in {state}")

    def cleanup() -> None:
        a.remove_remote_agent(remote)
        a.deregister_memory(reg_a)
        b.deregister_memory(reg_b)
        buffers.clear()  # registered memory must outlive its registration
    return run_once, cleanup


BASELINES: dict[str, tuple[str, Case]] = {
    # backend name -> (baseline label, baseline case)
    "shm": ("memcpy->shm", memcpy_shm_case),
    "tcp": ("pyzmq tcp", pyzmq_case),
    "nixl": ("nixl write", nixl_case),
}


# ---- kvrelay backends -------------------------------------------------------------------

def bench_layout(size: int):
    """4 KiB pages for the latency case, 256 KiB pages (a small model's real page size) for
    bandwidth."""
    from kvrelay.core.kvlayout import KVLayout
    layers = 1 if size <= LATENCY_SIZE else 64
    return KVLayout("bench", "float32", page_size=16, num_layers=layers, num_kv_heads=1, head_dim=32)


def backend_case(name: str, auth: bool = False) -> Case:
    def case(size: int):
        from kvrelay.core.config import TransferConfig
        from kvrelay.disagg import wire
        from kvrelay.disagg.transfer import create_manager
        from kvrelay.disagg.transfer.base import TransferStatus as S, host_pool
        layout = bench_layout(size)
        pages = list(range(size // layout.page_bytes))
        from kvrelay.core.keys import ClusterKey
        from kvrelay.disagg.auth import ChannelAuth
        key = ClusterKey.generate().control_key if auth else None
        p, d = (create_manager(name, layout, TransferConfig(transfer_backend=name),
                               auth=ChannelAuth(key) if key else None) for _ in range(2))
        host_pool(p, len(pages))[:] = filled(size)
        host_pool(d, len(pages))
        rooms = iter(range(1, 1 << 30))

        def pump_until(cond) -> None:
            deadline = time.monotonic() + 60
            while not cond():
                p.progress()
                d.progress()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: transfer did not finish in 60 s")

        def run_once() -> float:
            room = next(rooms)
            rcv, snd = d.receiver(room), p.sender(room)
            rcv.init(p.address)
            pump_until(lambda: rcv.poll() is S.WAITING)
            rcv.send_metadata(pages, epoch=room)
            pump_until(lambda: snd.poll() is S.WAITING)
            t = time.perf_counter()
            snd.send(pages, wire.Aux(0, 0, first_token=1))
            pump_until(lambda: snd.poll() is not S.TRANSFERRING)
            elapsed = time.perf_counter() - t
            if snd.poll() is not S.SUCCESS:
                raise RuntimeError(f"{name}: {snd.failure_reason} {snd.failure_detail}")
            pump_until(lambda: rcv.poll() is S.SUCCESS)
            snd.close()
            rcv.close()
            return elapsed

        def cleanup() -> None:
            p.close()
            d.close()
        return run_once, cleanup
    return case


BACKEND_CASES: dict[str, Case] = {name: backend_case(name) for name in BASELINES}


# ---- report ------------------------------------------------------------------------------

def measure_rows(labels: list[str], cases: list[Case], quick: bool) -> list[dict]:
    rows = [{"name": label} for label in labels]
    for row, t in zip(rows, median_seconds(cases, LATENCY_SIZE, quick)):
        row["lat_us"] = t * 1e6
    for size in SIZES:
        for row, t in zip(rows, median_seconds(cases, size, quick)):
            row[size] = size / t / 1e9
    return rows


def fmt_row(row: dict, base: dict | None = None) -> str:
    cells = [f"{row['name']:<14}", f"{row['lat_us']:>9.1f}"]
    for size in SIZES:
        ratio = f" ({row[size] / base[size]:.2f}x)" if base else ""
        cells.append(f"{row[size]:>7.2f}{ratio:<8}")
    return " ".join(cells)


def print_table(rows: list[tuple[dict, dict | None]]) -> None:
    head = [f"{'case':<14}", f"{'4KiB rt us':>9}"] + [f"{s // MIB:>5} MiB GB/s" for s in SIZES]
    print(" ".join(head))
    for row, base in rows:
        print(fmt_row(row, base))


TARGET_RATIO = 0.8
TARGET_SIZES = (16 * MIB, 256 * MIB)  # where bandwidth, not the Aux/Ack round trip, dominates


def print_targets(rows: list[tuple[dict, dict | None]]) -> None:
    for row, base in rows:
        if base is None:
            continue
        ratios = {size: row[size] / base[size] for size in TARGET_SIZES}
        verdict = "met" if all(r >= TARGET_RATIO for r in ratios.values()) else "MISSED"
        shown = ", ".join(f"{s // MIB} MiB {r:.2f}x" for s, r in ratios.items())
        print(f"target {row['name']} >= {TARGET_RATIO}x {base['name']}: {verdict} ({shown})")


def cpu_model() -> str:
    """lscpu's model name: every figure is for one CPU."""
    import subprocess
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="shm,tcp,nixl")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--baselines-only", action="store_true")
    ap.add_argument("--auth", action="store_true", help="also measure each backend with a cluster key")
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_model()}")
    rows = []
    for name in args.backends.split(","):
        label, case = BASELINES[name]
        if args.baselines_only:
            rows.append((measure_rows([label], [case], args.quick)[0], None))
            continue
        labels, cases = [label, name], [case, BACKEND_CASES[name]]
        if args.auth:
            labels.append(f"{name}+auth")
            cases.append(backend_case(name, auth=True))
        base, *mine = measure_rows(labels, cases, args.quick)
        rows += [(base, None)] + [(row, base) for row in mine]
    print_table(rows)
    print_targets(rows)


if __name__ == "__main__":
    main()

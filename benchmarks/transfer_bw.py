"""KV transfer latency and bandwidth: each backend next to the plain baseline it must approach.

    .venv/bin/python benchmarks/transfer_bw.py [--backends shm,tcp,nixl] [--quick]

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
# and returns when the sender knows they landed.
Case = Callable[[int], "tuple[Callable[[], None], Callable[[], None]]"]


def reps_for(size: int, quick: bool) -> int:
    if size <= LATENCY_SIZE:
        return 50 if quick else 200
    n = 3 if size >= 256 * MIB else 10 if size >= 16 * MIB else 30
    return max(2, n // 3) if quick else n


def median_seconds(case: Case, size: int, quick: bool) -> float:
    run_once, cleanup = case(size)
    try:
        run_once()  # warm-up: first touch of pages, connection setup
        times = []
        for _ in range(reps_for(size, quick)):
            t = time.perf_counter()
            run_once()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    finally:
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


def nixl_case(size: int):
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config
    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent(f"bench-a-{size}", cfg), nixl_agent(f"bench-b-{size}", cfg)
    src, dst = np.frombuffer(filled(size), np.uint8), np.zeros(size, np.uint8)
    reg_a = a.register_memory([(src.ctypes.data, size, 0, "")], "DRAM")
    reg_b = b.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM")
    remote = a.add_remote_agent(b.get_agent_metadata())
    local_descs = a.get_xfer_descs([(src.ctypes.data, size, 0)], "DRAM")
    remote_descs = a.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM")

    def run_once() -> None:
        handle = a.initialize_xfer("WRITE", local_descs, remote_descs, remote)
        state = a.transfer(handle)
        while state == "PROC":
            state = a.check_xfer_state(handle)
        a.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL write ended in {state}")

    def cleanup() -> None:
        a.remove_remote_agent(remote)
        a.deregister_memory(reg_a)
        b.deregister_memory(reg_b)
    return run_once, cleanup


BASELINES: dict[str, tuple[str, Case]] = {
    # backend name -> (baseline label, baseline case)
    "shm": ("memcpy->shm", memcpy_shm_case),
    "tcp": ("pyzmq tcp", pyzmq_case),
    "nixl": ("nixl write", nixl_case),
}


# ---- report ------------------------------------------------------------------------------

def measure_row(label: str, case: Case, quick: bool) -> dict:
    row = {"name": label, "lat_us": median_seconds(case, LATENCY_SIZE, quick) * 1e6}
    for size in SIZES:
        row[size] = size / median_seconds(case, size, quick) / 1e9
    return row


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="shm,tcp,nixl")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--baselines-only", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for name in args.backends.split(","):
        label, case = BASELINES[name]
        base = measure_row(label, case, args.quick)
        rows.append((base, None))
        if not args.baselines_only:
            rows.append((measure_row(name, BACKEND_CASES[name], args.quick), base))
    print_table(rows)


BACKEND_CASES: dict[str, Case] = {}

if __name__ == "__main__":
    main()

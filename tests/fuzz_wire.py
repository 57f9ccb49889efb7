"""By hand: 10,000 fuzzed wire frames (tests/wire_fuzz_strategies.py) with real zmq to a
prefill and a decode worker core (tcp backend, tiny random model, in this process) while
requests keep running; then every request's tokens are compared with a colocated run of
the same request, and both workers must end idle with every page free.

    .venv/bin/python tests/fuzz_wire.py [--frames 10000] [--seed 0] [--keyed]

--keyed: the workers share a cluster key, and the fuzzer holds it too (an insider): every
frame is sealed for its destination, so the fuzz reaches the validation behind the
authentication; one in twenty goes out unsealed, one in twenty sealed with another key.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import zmq  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from kvrelay.core.config import KVCacheConfig, ModelOptions, SchedulerConfig  # noqa: E402
from kvrelay.core.keys import ClusterKey  # noqa: E402
from kvrelay.disagg.auth import ChannelAuth  # noqa: E402
from kvrelay.engine.engine import build_engine  # noqa: E402
from kvrelay.engine.loader import load_model  # noqa: E402
from kvrelay.engine.models.testing import make_tiny_model_dir  # noqa: E402
from kvrelay.obs.metrics import REJECTED_INPUT  # noqa: E402
from test_worker_cores import Pair, colocated, greedy, tokens  # noqa: E402
from wire_fuzz_strategies import frames  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keyed", action="store_true", help="workers and fuzzer share a cluster key")
    args = ap.parse_args()
    key = ClusterKey.generate() if args.keyed else None
    loaded = load_model(ModelOptions(model=f"random:{make_tiny_model_dir(tempfile.mkdtemp(), arch='llama', seed=0)}",
                                     dtype="float32", seed=0, served_model_name="tiny-llama"))
    ref = build_engine(loaded, KVCacheConfig(page_size=16, max_kv_tokens=4096),
                       SchedulerConfig(max_running_requests=32, max_prefill_tokens=1024))
    pair = Pair(loaded, "tcp", cluster_key=key)
    pair.room = random.Random(args.seed).getrandbits(62)  # random room ids, as the router draws them
    reqs = [greedy(f"q{i}", range(3 + i, 30 + 4 * i), n=12) for i in range(8)]
    expected = asyncio.run(_run_all(lambda g: colocated(ref, g), reqs))
    expected = {g.rid: tokens(o) for g, o in zip(reqs, expected)}
    sent = [0]
    done = threading.Event()

    def fuzz():
        ctx = zmq.Context.instance()
        socks = []
        addresses = (pair.paddr, pair.D.core.manager.address)
        for address in addresses:
            s = ctx.socket(zmq.PUSH)
            if key:   # past the handshake: the fuzz reaches the auth frame and the validation
                s.plain_username, s.plain_password = b"kvrelay", key.channel_password.encode()
            s.connect(address)
            socks.append(s)
        insider = ChannelAuth(key.control_key) if key else None
        outsider = ChannelAuth(ClusterKey.generate().control_key)

        @seed(args.seed)
        @settings(max_examples=args.frames, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(frames(pair.P.core.engine.layout))
        def one(parts):
            if insider is not None and parts:
                auth = outsider if sent[0] % 20 == 1 else insider
                if sent[0] % 20 != 11:  # 1 in 20 unsealed, 1 in 20 sealed with another key
                    dst = addresses[sent[0] % 2]
                    parts = [auth.seal(dst, bytes(parts[0]), parts[1:]), *parts]
            if not os.environ.get("NOSEND"):
                socks[sent[0] % 2].send_multipart(parts)
            sent[0] += 1
            time.sleep(0.0005)

        try:
            while sent[0] < args.frames:
                one()
        finally:
            for s in socks:
                s.close(linger=1000)
            done.set()

    t0 = time.monotonic()
    threading.Thread(target=fuzz, daemon=True).start()
    served = bad = 0

    async def load():
        nonlocal served, bad
        while not done.is_set():
            outs = await asyncio.gather(*(pair.run(g) for g in reqs))
            for g, (p_outs, d_outs) in zip(reqs, outs):
                served += 1
                if any(o.error for o in p_outs + d_outs) or tokens(d_outs) != expected[g.rid]:
                    bad += 1
                    print("MISMATCH", g.rid, [o.error for o in p_outs + d_outs if o.error])

    asyncio.run(load())
    elapsed = time.monotonic() - t0
    pair.assert_idle()
    rejected = {tuple(s.labels.values()): s.value for m in REJECTED_INPUT.collect() for s in m.samples
                if s.name.endswith("_total")}
    print(f"frames sent: {sent[0]} in {elapsed:.1f} s; requests served beside them: {served}, "
          f"wrong or failed: {bad}; both workers idle, every page free")
    print("rejected:", dict(sorted(rejected.items())))
    pair.close()
    ref.shutdown()
    return 1 if bad else 0


async def _run_all(fn, reqs):
    return [await fn(g) for g in reqs]


if __name__ == "__main__":
    sys.exit(main())

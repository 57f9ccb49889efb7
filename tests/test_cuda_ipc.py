"""The cuda_ipc backend: its endpoint is checked before torch sees it (here), and on a CUDA
device (`pytest -m gpu`) P writes a room's pages into D's pool in another process."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from disagg_helpers import LAYOUT, opened
from kvrelay.core.config import TransferConfig
from kvrelay.disagg.transfer import TRANSFER_BACKENDS, create_manager
from kvrelay.disagg.transfer.base import host_pool


def test_cuda_ipc_moves_device_memory_only():
    assert TRANSFER_BACKENDS.get("cuda_ipc").memory == ("cuda",)
    assert TRANSFER_BACKENDS.get("cuda_ipc").one_sided


@pytest.mark.parametrize("endpoint,match", [
    ({"device": 0, "size": 10, "offset": 0, "ref_offset": 0, "pool_offset": 0, "bytes": 10,
      "event_sync": True, "handle": "!!", "ref_counter": "", "event": ""}, "malformed handle"),
    ({"device": -1, "size": 10, "offset": 0, "ref_offset": 0, "pool_offset": 0, "bytes": 10,
      "event_sync": True, "handle": "", "ref_counter": "", "event": ""}, "malformed integer"),
    ({"device": 0, "size": "10", "offset": 0, "ref_offset": 0, "pool_offset": 0, "bytes": 10,
      "event_sync": True, "handle": "", "ref_counter": "", "event": ""}, "malformed integer"),
    ({"device": 0, "size": 10, "offset": 0, "ref_offset": 0, "pool_offset": 0, "bytes": 10,
      "event_sync": 1, "handle": "", "ref_counter": "", "event": ""}, "malformed integer or flag"),
    ({"device": 0, "size": 10, "offset": 0, "ref_offset": 0, "pool_offset": 0, "bytes": 10,
      "event_sync": True, "handle": "A" * 1000, "ref_counter": "", "event": ""}, "malformed handle"),
    ({"device": 0, "size": 10, "offset": 0, "ref_offset": 0, "pool_offset": 0, "bytes": 10,
      "event_sync": True, "handle": "", "ref_counter": "", "event": ""}, "names device 0, this process sees 0"),
])
def test_an_endpoint_is_checked_before_torch_sees_it(endpoint, match):
    from kvrelay.disagg.transfer.cuda_ipc import import_handle
    if torch.cuda.is_available():
        pytest.fail("this case runs where torch sees no GPU; tests/test_gpu.py covers CUDA")
    with pytest.raises(ValueError, match=match):
        import_handle(endpoint)


def test_a_host_pool_is_refused():
    with opened("cuda_ipc") as m:
        with pytest.raises(ValueError, match="the cuda_ipc transfer backend moves cuda memory, not cpu"):
            host_pool(m, 4)


def _decode_side(layout, num_pages, conn) -> None:
    """D in its own process: a CUDA pool registered with cuda_ipc; reports what landed."""
    d = create_manager("cuda_ipc", layout, TransferConfig(transfer_backend="cuda_ipc"))
    flat = torch.zeros(num_pages * layout.page_bytes, dtype=torch.uint8, device="cuda")
    d.register_kv([_region(flat, layout)])
    conn.send(d.address)
    room, pages, epoch = conn.recv()
    rcv = d.receiver(room)
    rcv.init(conn.recv())
    _pump(d, lambda: rcv.poll().value >= 1)
    rcv.send_metadata(pages, epoch)
    _pump(d, lambda: rcv.poll().terminal)
    pb = layout.page_bytes
    conn.send((rcv.poll().name, [bytes(flat[p * pb:(p + 1) * pb].cpu().numpy()) for p in pages]))
    rcv.close()
    conn.recv()
    d.close()


def _region(flat, layout):
    from kvrelay.engine.kv_pool import TensorStager
    from kvrelay.core.kvlayout import KVRegion
    return KVRegion(flat.data_ptr(), flat.numel(), str(flat.device), layout, stage=TensorStager(flat), handle=flat)


def _pump(manager, cond, limit: float = 30.0) -> None:
    import time
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "the transfer did not finish"
        manager.progress()


@pytest.mark.gpu
def test_pages_land_in_another_process_pool():
    from disagg_helpers import pattern
    from kvrelay.disagg import wire
    from kvrelay.disagg.transfer.base import TransferStatus as S
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(LAYOUT, 16, there))
    proc.start()
    p = create_manager("cuda_ipc", LAYOUT, TransferConfig(transfer_backend="cuda_ipc"))
    try:
        pb = LAYOUT.page_bytes
        flat = torch.zeros(16 * pb, dtype=torch.uint8, device="cuda")
        p.register_kv([_region(flat, LAYOUT)])
        src, dst = [9, 3, 4, 12, 0], [1, 2, 3, 15, 8]
        data = pattern(3, len(src) * pb)
        for i, s in enumerate(src):
            flat[s * pb:(s + 1) * pb] = torch.frombuffer(bytearray(data[i * pb:(i + 1) * pb]),
                                                         dtype=torch.uint8).cuda()
        here.recv()                                     # D's address
        here.send((1, dst, 4))
        here.send(p.address)
        snd = p.sender(1)
        _pump(p, lambda: snd.poll() is not S.BOOTSTRAPPING)
        snd.send(src, wire.Aux(0, 0, first_token=9))
        _pump(p, lambda: snd.poll().terminal or here.poll())
        status, landed = here.recv()
        assert status == "SUCCESS"
        assert b"".join(landed) == data
        _pump(p, lambda: snd.poll().terminal)
        assert snd.poll() is S.SUCCESS
        snd.close()
        here.send("done")
    finally:
        proc.join(timeout=60)
        p.close()
    assert proc.exitcode == 0

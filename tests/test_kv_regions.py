"""The engine owns the KV pool; transfer backends register it (`register_kv`, `KVRegion`).

Device memory is checked here through its contract: a region with a stager instead of a
host view (a CPU tensor stands in for device memory; tests/test_cuda_ipc.py and
tests/test_gpu_serving.py run CUDA)."""
from __future__ import annotations

import pytest
import torch

from disagg_helpers import LAYOUT, opened, pattern
from kvrelay.core.config import TransferConfig
from kvrelay.core.kvlayout import KVRegion
from kvrelay.disagg import wire
from kvrelay.disagg.channel import InProcNetwork
from kvrelay.disagg.transfer import TRANSFER_BACKENDS, create_manager
from kvrelay.disagg.transfer.base import TransferStatus as S, host_pool
from kvrelay.engine.kv_pool import KVPool, TensorStager
from test_backends import REAL, Pair

PB = LAYOUT.page_bytes


class NoStager:
    def read(self, offset, length):
        raise AssertionError("not read")

    def write(self, offset, data):
        raise AssertionError("not written")


def staged_region(num_pages: int, device: str = "cpu") -> tuple[KVRegion, torch.Tensor]:
    flat = torch.zeros(num_pages * PB, dtype=torch.uint8)
    return KVRegion(flat.data_ptr(), flat.numel(), device, LAYOUT, stage=TensorStager(flat), handle=flat), flat


def test_a_region_is_whole_pages_with_one_way_in():
    buf = memoryview(bytearray(2 * PB))
    with pytest.raises(ValueError, match="either a host view or a stager"):
        KVRegion(0, 2 * PB, "cpu", LAYOUT)
    with pytest.raises(ValueError, match="either a host view or a stager"):
        KVRegion(0, 2 * PB, "cpu", LAYOUT, host=buf, stage=NoStager())
    with pytest.raises(ValueError, match="not whole pages"):
        KVRegion.of_host(buf[:PB + 1], LAYOUT)
    region = KVRegion.of_host(buf, LAYOUT)
    assert (region.num_pages, region.device_type, region.nbytes) == (2, "cpu", 2 * PB)


def test_the_engine_pool_is_the_registered_memory():
    pool = KVPool(LAYOUT, 4)
    region = pool.region()
    assert (region.ptr, region.nbytes, region.device) == (pool.data.data_ptr(), 4 * PB, "cpu")
    region.host[PB:2 * PB] = pattern(1, PB)          # what a peer's write does
    assert pool.read_pages([1]) == pattern(1, PB)    # is what the engine reads


HOST_ONLY = [b for b in TRANSFER_BACKENDS.names()
             if (b in REAL or b.startswith("fake")) and TRANSFER_BACKENDS.get(b).memory == ("cpu",)]


@pytest.mark.parametrize("backend", HOST_ONLY)
def test_a_host_backend_refuses_device_memory(backend):
    kw = {} if backend in REAL else {"network": InProcNetwork()}
    with opened(backend, **kw) as m:
        region = KVRegion(1 << 20, 4 * PB, "cuda:0", LAYOUT, stage=NoStager())
        with pytest.raises(ValueError, match=f"the {backend} transfer backend moves cpu memory, not cuda:0"):
            m.register_kv([region])
        assert m.region is None


def test_every_backend_says_which_memory_it_moves():
    memory = {b: TRANSFER_BACKENDS.get(b).memory for b in TRANSFER_BACKENDS.names() if b in REAL}
    assert memory["shm"] == ("cpu",)
    assert "cuda" in memory["tcp"]   # staged through host memory


def test_register_kv_refuses_two_pools_and_another_layout():
    from dataclasses import replace
    with opened("tcp") as m:
        with pytest.raises(ValueError, match="layout differs: page_size"):
            m.register_kv([KVRegion.of_host(bytearray(replace(LAYOUT, page_size=8).page_bytes * 2),
                                            replace(LAYOUT, page_size=8))])
        host_pool(m, 4)
        with pytest.raises(RuntimeError, match="registered once"):
            host_pool(m, 4)


def test_shm_moves_only_the_pool_placed_in_its_segment():
    with opened("shm") as m:
        with pytest.raises(ValueError, match="placed in its segment"):
            m.register_kv([KVRegion.of_host(bytearray(4 * PB), LAYOUT)])
        placed = m.place_pool(4 * PB)
        m.register_kv([KVRegion.of_host(placed, LAYOUT)])
        assert m.endpoint()["bytes"] == 4 * PB


def test_tcp_moves_device_pages_through_their_stagers(monkeypatch):
    """P's and D's pools both without a host view: P stages each chunk out, D each chunk in."""
    monkeypatch.setattr(TensorStager, "PIECE", PB + 3)   # several pieces per chunk, unaligned
    pair = Pair.__new__(Pair)
    pair.p = create_manager("tcp", LAYOUT, TransferConfig(transfer_backend="tcp"))
    pair.d = create_manager("tcp", LAYOUT, TransferConfig(transfer_backend="tcp"))
    try:
        (p_region, p_flat), (d_region, d_flat) = staged_region(16), staged_region(16)
        pair.p.register_kv([p_region])
        pair.d.register_kv([d_region])
        src, dst = [9, 3, 4, 12, 0], [1, 2, 3, 15, 8]
        data = pattern(7, len(src) * PB)
        for i, p in enumerate(src):
            p_flat[p * PB:(p + 1) * PB] = torch.frombuffer(bytearray(data[i * PB:(i + 1) * PB]), dtype=torch.uint8)
        snd, rcv = pair.rendezvous(1, dst, epoch=2)
        snd.send(src, wire.Aux(0, 0, first_token=5))
        assert pair.pump_until(lambda: snd.poll() is S.SUCCESS and rcv.poll() is S.SUCCESS)
        got = b"".join(d_flat[p * PB:(p + 1) * PB].numpy().tobytes() for p in dst)
        assert got == data
        others = [p for p in range(16) if p not in dst]
        assert all(not d_flat[p * PB:(p + 1) * PB].any() for p in others)   # nothing else landed
        snd.close()
        rcv.close()
    finally:
        pair.close()

"""The KV pool reads and writes page sets as raw buffers (what a transfer moves)."""
import torch

from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine.kv_pool import KVPool

LAYOUT = KVLayout("m", "bfloat16", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def test_page_sets_round_trip_as_bytes_and_share_one_buffer():
    pool = KVPool(LAYOUT, num_pages=6)
    assert len(pool.buffer()) == 6 * LAYOUT.page_bytes
    data = bytes(range(256)) * (2 * LAYOUT.page_bytes // 256)
    pool.write_pages([4, 1], data)
    assert pool.read_pages([4, 1]) == data
    assert pool.read_pages([1]) == data[LAYOUT.page_bytes:]
    assert bytes(pool.buffer()[4 * LAYOUT.page_bytes:5 * LAYOUT.page_bytes]) == data[:LAYOUT.page_bytes]
    assert pool.read_pages([0]) == bytes(LAYOUT.page_bytes)  # untouched pages stay zero


def test_a_caller_buffer_backs_the_pool():
    raw = bytearray(3 * LAYOUT.page_bytes)
    pool = KVPool(LAYOUT, num_pages=3, buffer=memoryview(raw))
    pool.data[2].fill_(1.0)
    assert raw[2 * LAYOUT.page_bytes:] == bytes(pool.read_pages([2]))
    assert torch.frombuffer(raw, dtype=torch.bfloat16)[-1].item() == 1.0

"""The KV pool reads and writes page sets as raw buffers (what a transfer moves)."""
import gc
import zlib
from multiprocessing import shared_memory

import pytest
import torch

from kvrelay.core.kvlayout import KVLayout
from kvrelay.engine.kv_pool import KVPool, kv_pool_for

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


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_the_checksum_covers_every_byte_of_the_pages_in_order(kv_dtype):
    """What --verify-kv compares: two pools holding the same bytes under other page ids
    agree; a flipped byte anywhere in a page (an 8-bit pool's scales included), or the
    pages in another order, disagree. The value is zlib's CRC-32 of the pages' bytes."""
    layout = KVLayout("m", "bfloat16", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype=kv_dtype)
    p, d = kv_pool_for(layout, 6), kv_pool_for(layout, 9)
    data = bytes((i * 7 + 3) % 251 for i in range(3 * layout.page_bytes))
    p.write_pages([5, 0, 2], data)
    d.write_pages([1, 8, 4], data)
    assert p.checksum([5, 0, 2]) == d.checksum([1, 8, 4]) == zlib.crc32(data)
    assert d.checksum([8, 1, 4]) != d.checksum([1, 8, 4])
    for at in (0, layout.page_bytes - 1, 2 * layout.page_bytes + 5):
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        d.write_pages([1, 8, 4], bytes(flipped))
        assert d.checksum([1, 8, 4]) != p.checksum([5, 0, 2]), at


def test_a_caller_buffer_backs_the_pool():
    raw = bytearray(3 * LAYOUT.page_bytes)
    pool = KVPool(LAYOUT, num_pages=3, buffer=memoryview(raw))
    pool.data[2].fill_(1.0)
    assert raw[2 * LAYOUT.page_bytes:] == bytes(pool.read_pages([2]))
    assert torch.frombuffer(raw, dtype=torch.bfloat16)[-1].item() == 1.0


BIG = KVLayout("m", "bfloat16", page_size=16, num_layers=4, num_kv_heads=2, head_dim=64)   # 32 KiB pages


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_pool_asks_linux_for_huge_pages_and_starts_zeroed():
    pool = KVPool(BIG, num_pages=128)   # 4 MiB
    assert pool.huge_pages_advised
    assert "hg" in vm_flags(pool.region().ptr)   # MADV_HUGEPAGE on the pool's own mapping
    assert pool.read_pages([0, 127]) == bytes(2 * BIG.page_bytes)
    pool.data[127].fill_(2.0)
    assert torch.frombuffer(bytearray(pool.read_pages([127])), dtype=torch.bfloat16).eq(2.0).all()


def test_a_shared_memory_pool_is_advised_too():
    seg = shared_memory.SharedMemory(create=True, size=128 * BIG.page_bytes)
    try:
        pool = KVPool(BIG, num_pages=128, buffer=seg.buf)
        assert pool.huge_pages_advised and "hg" in vm_flags(pool.region().ptr)
        pool.data[3].fill_(1.0)
        assert bytes(seg.buf[3 * BIG.page_bytes:4 * BIG.page_bytes]) == pool.read_pages([3])
        del pool
        gc.collect()
    finally:
        seg.close()
        seg.unlink()

"""Layer-wise transfer: P writes each layer's KV to D while the prompt's later layers
compute (`disagg.layerwise`, `KVSender.send_ahead`), and the send at the prompt's end
writes only the rest. What D holds at the end must be byte for byte what P computed."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from disagg_helpers import BACKENDS, LAYOUT, Harness, with_cfg
from kvrelay.core.kvlayout import KVLayout, PagePart, part_runs
from kvrelay.disagg import wire
from kvrelay.disagg.layerwise import LayerCursor
from kvrelay.disagg.transfer import TRANSFER_BACKENDS
from kvrelay.engine import core as engine_core
from kvrelay.engine.kv_pool import kv_pool_for
from kvrelay.engine.types import FinishReason
from test_worker_cores import REAL, Pair, both_ways, greedy, tokens

# the backends here that write byte spans within a page (the one-sided fake too)
WITHIN_PAGES = [b for b in BACKENDS if TRANSFER_BACKENDS.get(b).writes_within_pages]


@pytest.mark.parametrize("kv_dtype", ["", "int8"])
def test_layer_spans_hold_exactly_the_bytes_a_layer_writes(kv_dtype):
    """Storing one layer's K/V changes bytes inside that layer's spans only, and the spans
    of all layers cover every byte any layer's store changes."""
    layout = KVLayout("m", "bfloat16", page_size=4, num_layers=3, num_kv_heads=2, head_dim=8, kv_dtype=kv_dtype)
    pool = kv_pool_for(layout, 3)
    slots = pool.slot_ids(torch.tensor([1, 1, 1, 1]), torch.arange(4))
    covered = np.zeros(layout.page_bytes, dtype=bool)
    for layer in range(layout.num_layers):
        before = np.frombuffer(pool.buffer(), np.uint8).copy()
        k, v = torch.randn(4, 2, 8) + 1, torch.randn(4, 2, 8) - 1
        pool.write(layer, slots, k.to(torch.bfloat16), v.to(torch.bfloat16))
        after = np.frombuffer(pool.buffer(), np.uint8)
        changed = np.flatnonzero(before != after)
        assert changed.size and (changed // layout.page_bytes == 1).all()
        inside = np.zeros(layout.page_bytes, dtype=bool)
        for off, n in layout.layer_spans(layer, layer + 1):
            inside[off:off + n] = True
        assert inside[changed % layout.page_bytes].all(), layer
        covered |= inside
    whole = np.zeros(layout.page_bytes, dtype=bool)
    for off, n in layout.layer_spans(0, layout.num_layers):
        whole[off:off + n] = True
    assert (whole == covered).all()
    assert len(layout.layer_spans(0, 3)) == (2 if kv_dtype else 1)


def test_part_runs_refuse_parts_outside_the_pages_or_the_page():
    with pytest.raises(ValueError):
        part_runs([PagePart(1, 2)], [4, 5], [7, 8], 64)
    with pytest.raises(ValueError):
        part_runs([PagePart(0, 1, ((60, 8),))], [4], [7], 64)
    assert part_runs([PagePart(0, 2, ((8, 4),))], [4, 5], [7, 9], 64) == [(264, 456, 4), (328, 584, 4)]
    assert part_runs([PagePart(0, 2)], [4, 5], [7, 8], 64) == [(256, 448, 128)]


def test_tcp_pieces_group_one_span_of_consecutive_pages_and_chunk_whole_pages():
    from kvrelay.disagg.transfer.tcp import pieces
    pb = 64
    runs = part_runs([PagePart(0, 3, ((8, 4),)), PagePart(3, 2)], [10, 11, 20, 12, 13], [4, 5, 6, 8, 9], pb)
    got = [(p.reads, p.first_page, p.num_pages, p.offset, p.length) for p in pieces(runs, pb, 1 << 20)]
    assert got == [([(648, 4), (712, 4), (1288, 4)], 4, 3, 8, 4), ([(768, 128)], 8, 2, 0, 0)]
    small = pieces(runs, pb, 64)   # the limit cuts both kinds, never below one page or one span
    assert [p.num_pages for p in small] == [3, 1, 1] and [p.nbytes for p in small] == [12, 64, 64]
    with pytest.raises(ValueError):
        pieces([(0, 60, 8)], pb, 1 << 20)   # crosses a page boundary


class Model:
    """P's pages and D's as byte arrays in a small layout: a pass over tokens [s, e)
    computes layer by layer; bytes of slots not computed yet hold garbage."""

    def __init__(self, layout: KVLayout, prompt_len: int, rng: random.Random) -> None:
        self.layout, self.prompt_len, self.rng = layout, prompt_len, rng
        self.pages = -(-prompt_len // layout.page_size)
        pb = layout.page_bytes
        self.p = np.frombuffer(rng.randbytes(self.pages * pb), np.uint8).copy()
        self.d = np.frombuffer(rng.randbytes(self.pages * pb), np.uint8).copy()
        self.final = self.p.copy()   # what a computed slot holds
        self.final[:] = np.frombuffer(rng.randbytes(self.pages * pb), np.uint8)

    def slot_bytes(self, layer: int, first: int, last: int) -> np.ndarray:
        """Byte positions of tokens [first, last) of `layer` (K and V, every head; scales too)."""
        H, S, D = self.layout.num_kv_heads, self.layout.page_size, self.layout.head_dim
        eb = self.layout.layer_bytes // (2 * H * S * D)
        out = []
        for t in range(first, last):
            page, slot = divmod(t, S)
            base = page * self.layout.page_bytes
            for kv in range(2):
                for h in range(H):
                    vec = ((layer * 2 + kv) * H + h) * S + slot
                    out.append(base + vec * D * eb + np.arange(D * eb))
                    if self.layout.quantized:
                        out.append(base + self.layout.scales_offset + vec * 4 + np.arange(4))
        return np.concatenate(out)

    def compute(self, layer: int, first: int, last: int) -> None:
        at = self.slot_bytes(layer, first, last)
        self.p[at] = self.final[at]

    def write(self, parts: list[PagePart]) -> None:
        pb = self.layout.page_bytes
        for s, d, n in part_runs(parts, list(range(self.pages)), list(range(self.pages)), pb):
            self.d[d:d + n] = self.p[s:s + n]

    def check(self) -> None:
        at = np.concatenate([self.slot_bytes(layer, 0, self.prompt_len) for layer in range(self.layout.num_layers)])
        assert (self.d[at] == self.final[at]).all()


@pytest.mark.parametrize("kv_dtype", ["", "int8"])
@pytest.mark.parametrize("seed", range(40))
def test_what_went_ahead_plus_the_rest_is_every_final_byte(seed, kv_dtype):
    """Random prompts, chunkings, callback points (none, some, every layer) and restarts
    (a preempted prompt recomputed from 0): after the parts `finish` returns, D holds P's
    final bytes for every token of the prompt, every layer."""
    rng = random.Random(seed)
    layout = KVLayout("m", "float32", page_size=rng.choice([1, 3, 4]), num_layers=rng.randint(1, 5),
                      num_kv_heads=rng.randint(1, 2), head_dim=2, kv_dtype=kv_dtype)
    prompt_len = rng.randint(1, 40)
    model, cursor = Model(layout, prompt_len, rng), LayerCursor(layout)
    restarts = rng.choice([0, 0, 1])
    start = 0
    while start < prompt_len:
        end = min(prompt_len, start + rng.randint(1, 15))
        for layer in range(layout.num_layers):
            model.compute(layer, start, end)
            if rng.random() < 0.5:
                model.write(cursor.advance(start, end, layer + 1))
        start = end
        if restarts and start < prompt_len and rng.random() < 0.3:
            restarts, start = 0, 0   # preempted: recomputed from the first token
    model.write(cursor.finish(prompt_len, model.pages))
    model.check()


def test_a_prompt_whose_layers_all_went_ahead_leaves_nothing_for_the_end():
    layout = KVLayout("m", "float32", page_size=4, num_layers=3, num_kv_heads=1, head_dim=2)
    cursor = LayerCursor(layout)
    assert cursor.advance(0, 10, 1) == [PagePart(0, 3, layout.layer_spans(0, 1))]
    assert cursor.advance(0, 10, 3) == [PagePart(0, 3, layout.layer_spans(1, 3))]
    assert cursor.finish(10, 3) == []
    cursor = LayerCursor(layout)
    cursor.advance(0, 6, 2)
    # the next chunk: the first one's last layer, its one full page final; then the new chunk
    assert cursor.advance(6, 10, 1) == [PagePart(0, 2, layout.layer_spans(2, 3)),
                                        PagePart(1, 2, layout.layer_spans(0, 1))]
    assert cursor.finish(10, 3) == [PagePart(1, 2, layout.layer_spans(1, 3))]


# ---- the sender: writes ahead, then the rest, then aux -----------------------------------------
def _ahead_room(h: Harness, room: int, n: int = 3) -> tuple[list[int], bytes]:
    """A room in prefill on P with its pages filled (P's 'engine' computed them)."""
    h.request(room, n)
    assert h.run_until(lambda: h.phase("P", room) == "queued", 10), h.events
    h.P.take_queued(10)
    pages = h.palloc.allocate(n, room)
    pb = LAYOUT.page_bytes
    data = bytes(np.random.default_rng(room).integers(0, 256, n * pb, dtype=np.uint8))
    for i, p in enumerate(pages):
        h.ppool[p * pb:(p + 1) * pb] = data[i * pb:(i + 1) * pb]
    return pages, data


AUX = wire.Aux(0, 0, first_token=7, prompt_tokens=10)


@pytest.mark.parametrize("backend", WITHIN_PAGES)
def test_writes_ahead_and_the_rest_land_every_byte_then_aux(backend):
    h = Harness(backend)
    try:
        pages, data = _ahead_room(h, 1)
        cursor = LayerCursor(LAYOUT)
        h.P.send_ahead(1, pages, cursor.advance(0, 10, 1))
        assert h.run_until(lambda: h.pm.bytes_ahead == 3 * LAYOUT.layer_bytes, 5)
        assert not h.P._senders[1].aux_sent
        h.P.prefill_done(1, pages, AUX, cursor.finish(10, 3))
        assert h.run_until(lambda: h.phase("D", 1) == "decode" or 1 in [r for r, _ in h.D.take_ready()])
        assert h.d_pages(h.dalloc.pages_of(1)) == data
        assert h.pm.bytes_written == 3 * LAYOUT.page_bytes   # each byte once
        h.D.finish(1)
        h.assert_no_leak()
    finally:
        h.close()


@pytest.mark.parametrize("backend", WITHIN_PAGES)
def test_a_write_ahead_that_fails_fails_the_room_in_prefill(backend):
    h = Harness(backend, p_faults="fail_transfer=1.0")
    try:
        pages, _ = _ahead_room(h, 2)
        h.P.send_ahead(2, pages, LayerCursor(LAYOUT).advance(0, 10, 1))
        h.step()
        t_ev = h.event("P", 2)
        assert t_ev is not None and t_ev[1].reason == "transfer_error" and t_ev[1].from_phase == "prefill"
        h.assert_no_leak()
    finally:
        h.close()


@pytest.mark.parametrize("backend", WITHIN_PAGES)
def test_a_hung_write_ahead_holds_back_the_rest_and_aux_and_fails_within_the_lease(backend):
    """As a hung write does (`test_transfer_progress`): transfer_error within the lease,
    or, where writes are opaque (nixl), timeout:transfer."""
    h = Harness(backend, with_cfg(transfer_timeout=12.0, waiting_timeout=60.0), p_faults="hang_transfer=1.0")
    try:
        pages, _ = _ahead_room(h, 3)
        cursor = LayerCursor(LAYOUT)
        h.P.send_ahead(3, pages, cursor.advance(0, 10, 1))
        h.P.prefill_done(3, pages, AUX, cursor.finish(10, 3))
        sender = h.P._senders[3]
        assert not sender.job.begun and not sender.aux_sent   # waits for the write ahead
        bound = 12.0 if h.pm.opaque_writes else h.cfg.heartbeat_interval * (h.cfg.heartbeat_misses + 2)
        assert h.run_until(lambda: h.phase("P", 3) is None, bound + 1)
        assert h.event("P", 3)[1].reason == ("timeout:transfer" if h.pm.opaque_writes else "transfer_error")
        assert not sender.aux_sent
        h.assert_no_leak()
    finally:
        h.close()


# ---- worker cores: the engine's passes write ahead ---------------------------------------------
@pytest.mark.parametrize("backend", REAL)
@pytest.mark.parametrize("layerwise", [True, False])
def test_layer_wise_transfer_gives_colocated_tokens(tiny_loaded, tiny_engine, backend, layerwise, monkeypatch):
    """Every layer of every pass goes ahead (the between-layer period 0), prompts of one
    chunk and of several (the first budget is 256 tokens): D decodes colocated's tokens,
    and every real backend wrote ahead unless told not to."""
    monkeypatch.setattr(engine_core, "MID_STEP_PERIOD", 0.0)
    reqs = [greedy(f"lw{i}", [(7 * i + j) % 200 + 3 for j in range(n)], n=6) for i, n in enumerate([5, 33, 300, 700])]
    pair = Pair(tiny_loaded, backend, layerwise=layerwise)
    try:
        got, want = both_ways(pair, tiny_engine, reqs)
        for r, (pouts, douts), couts in zip(reqs, got, want):
            assert [o.finish_reason for o in pouts] == [FinishReason.LENGTH], r.rid
            assert tokens(douts) == tokens(couts), r.rid
        pm = pair.P.core.manager
        ahead = layerwise and pm.writes_within_pages
        assert (pm.bytes_ahead > 0) == ahead
        assert pm.bytes_written >= sum(-(-len(r.prompt_ids) // 16) for r in reqs) * pm.layout.page_bytes
        pair.assert_idle()
    finally:
        pair.close()

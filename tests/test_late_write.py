"""No late write: a failed request's pages are reused, then a write for the old (room, epoch)
lands late. The new owner's bytes must not change, on every backend."""
from __future__ import annotations

import pytest

from disagg_helpers import BACKENDS, LAYOUT, Harness, checksum, pattern, with_cfg
from kvrelay.disagg.transfer.base import WriteState


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("failure", ["decode_abort", "waiting_timeout"])
def test_late_write_never_corrupts_the_new_owner(backend, failure):
    H = Harness(backend, cfg=with_cfg(waiting_timeout=3.0, queue_timeout=100.0, transfer_timeout=100.0),
                p_faults="hang_transfer=1", num_pages=4)
    try:
        H.request(1)
        H.prefill(1)                                   # the write hangs: it never started
        old_job = H.P._senders[1].job
        old_pages = list(H.D.lc.rooms[1].data.pages)
        if failure == "decode_abort":
            H.D.abort(1)
        assert H.run_until(lambda: H.event("D", 1) is not None and H.event("P", 1) is not None, 10)
        one_sided = H.dm.one_sided
        assert (1 in H.D.quarantine) == one_sided      # one-sided: P never confirmed it stopped

        H.set_faults("P", "")
        H.request(2)
        H.prefill(2, seed=222)
        ready = []
        assert H.run_until(lambda: bool(ready.extend(H.D.take_ready()) or ready), 10)
        new_pages = list(H.D.lc.rooms[2].data.pages)
        if one_sided:
            assert not set(new_pages) & set(old_pages)  # quarantined pages were not reused
        else:
            assert new_pages == old_pages               # reused at once: the check must hold
        before = checksum(H.d_pages(new_pages))
        assert H.d_pages(new_pages) == pattern(222, 2 * LAYOUT.page_bytes)

        H.pm.write_start(old_job)                      # the late write for (room 1, old epoch)
        for _ in range(200):
            if old_job.state is WriteState.PENDING:
                H.pm.write_progress(old_job)
            H.step()
        assert checksum(H.d_pages(new_pages)) == before

        H.D.finish(2)
        H.assert_no_leak()                             # quarantine ends by its deadline
        assert H.d_released == {1: 1, 2: 1}
    finally:
        H.close()


def test_quarantine_ends_when_prefill_confirms_stopped(backend):
    H = Harness(backend, cfg=with_cfg(transfer_timeout=100.0, quarantine_grace=100.0))
    try:
        H.request(1)
        H.prefill(1)
        H.D.abort(1)
        # P aborts its sender, confirms Stopped; D releases long before transfer_timeout + grace
        assert H.run_until(lambda: not H.D.quarantine and H.event("P", 1) is not None, 5)
        H.assert_no_leak()
    finally:
        H.close()


def test_a_lost_destination_does_not_hold_the_quarantine(backend):
    """D's destination never reached P, then both sides abort (the router's deadline). P has
    nothing to confirm; D asks again every heartbeat, and once a Destination gets through,
    P's closed room answers Stopped: the pages come back long before the backstop."""
    H = Harness(backend, cfg=with_cfg(transfer_timeout=100.0, quarantine_grace=100.0),
                d_faults="drop:Destination=1")
    try:
        H.request(1)
        H.to_phase(1, "D", "waiting")
        H.step(10)
        assert H.phase("P", 1) == "bootstrap"           # the destination was lost
        H.D.abort(1)
        H.P.abort(1)
        H.step(5)
        assert (1 in H.D.quarantine) == H.dm.one_sided
        H.set_faults("D", "")
        t0 = H.clock.now()
        assert H.run_until(lambda: not H.D.quarantine, 10)
        assert H.clock.now() - t0 <= 2 * H.cfg.heartbeat_interval + 0.5
        H.assert_no_leak()
        assert H.d_released == {1: 1}
    finally:
        H.close()


def test_a_room_prefill_never_got_does_not_hold_the_quarantine(backend):
    """The room's leg never reached P (P was frozen when the router sent both legs), D sent
    its Destination and then ended the room (the router's deadline). P answers D's Notice and
    Destination for a room it never had with Stopped at once: the pages come back long before
    the backstop (before, D held them for transfer_timeout + quarantine_grace). The leg, should
    it reach P afterwards, fails at once and writes nothing into the released pages."""
    H = Harness(backend, cfg=with_cfg(transfer_timeout=100.0, quarantine_grace=100.0))
    try:
        H.request(1, on_p=False)
        H.to_phase(1, "D", "waiting")
        pages = list(H.D.lc.rooms[1].data.pages)
        H.D.abort(1)
        t0 = H.clock.now()
        assert H.run_until(lambda: 1 not in H.D.lc.rooms and not H.D.quarantine, 10)
        assert H.clock.now() - t0 <= 2 * H.cfg.heartbeat_interval + 0.5
        assert H.d_released == {1: 1}

        H.request(2, n_pages=len(pages))                # the released pages get a new owner
        H.prefill(2, seed=222)
        ready = []
        assert H.run_until(lambda: bool(ready.extend(H.D.take_ready()) or ready), 10)
        assert sorted(H.D.lc.rooms[2].data.pages) == sorted(pages)
        before = checksum(H.d_pages(pages))

        H.request(1, on_d=False)                        # room 1's leg reaches P at last
        assert H.run_until(lambda: H.event("P", 1) is not None, 10)
        assert H.event("P", 1)[1].reason in ("peer_failed", "aborted")
        assert H.phase("P", 1) is None
        H.step(20)
        assert checksum(H.d_pages(pages)) == before
        H.D.finish(2)
        H.assert_no_leak()
        assert H.d_released == {1: 1, 2: 1}
    finally:
        H.close()

"""Real bugs the simulation found, as the seed and shrunk fault schedule that showed each.

1. A pause of the whole cluster (a clock jump past the P<->D lease) let P land a
   one-sided write after D had declared P dead and released the room's quarantined pages:
   P's first iteration after the pause pumped its pending write before its own watchdog
   declared D dead. P now advances no write to a peer silent for the whole lease
   (`CommonManager.progress_job`).
2. D ended a one-sided quarantine as soon as it declared P dead, but a P that D declared
   dead may be alive (silent only towards D: a partition of the control path, a slow P,
   a pause) with a write in flight. D now ends a quarantine only on P's Stopped, on seeing
   a new incarnation of P, or at the backstop (transfer deadline + grace)
   (`DecodeSide._end_quarantines`).
3. Right after that fix: a quarantine whose writer was P's *new* incarnation ended at
   once, because D's lease still held P's previous incarnation and "another incarnation
   is on record" read as "the writer was replaced". A restart now counts only if an
   incarnation appears that was not visible when the quarantine began.
4. A false peer-end verdict (seed 20794047, found on a fresh range): P's transfer failed
   inside a long prefill pass, so P told D at once, while the P->D link was dropping
   frames, and the room ended in P's lifecycle only at the step's end, after the link had
   healed. The checker judged the notice by the link's state at that later moment. It now
   judges the Notice that was really sent (`SimNetwork.notices`): lost, so heartbeats are
   the backup and the lease bounds it.
"""
from __future__ import annotations

import pytest

from kvrelay.disagg.transfer.common import CommonManager
from kvrelay.core import mutation
from kvrelay.sim import faults as fl
from kvrelay.sim import net
from kvrelay.sim import run as sim_run
from kvrelay.disagg.decode_side import DecodeSide
from kvrelay.disagg.lease import Coordinator
from kvrelay.sim.run import SimConfig, run_seed

# Recorded before the router's adaptive split existed: replayed with it off.
BEFORE_SPLIT = SimConfig(split=0)

# (seed, shrunk schedule) of a cluster-wide pause past the lease while writes were pending
PAUSES = [
    (17, '[{"at":1.212,"kind":"clock_jump","target":"","duration":0.0,"params":{"seconds":1.834}}]'),
    (32, '[{"at":1.78,"kind":"clock_jump","target":"","duration":0.0,"params":{"seconds":2.595}}]'),
    (360, '[{"at":0.61,"kind":"clock_jump","target":"","duration":0.0,"params":{"seconds":2.598}}]'),
]
# (seed, shrunk schedule) where D released on "P declared dead" while P still wrote
GAPS = [
    (7, '[{"at":2.691,"kind":"partition","target":"prefill-0>decode-0","duration":4.234,"params":{}}]'),
    (19, '[{"at":0.282,"kind":"slow","target":"prefill-0","duration":3.83,"params":{"factor":50}},'
         '{"at":2.729,"kind":"clock_jump","target":"","duration":0.0,"params":{"seconds":1.17}}]'),
]


@pytest.fixture
def old_judges(monkeypatch):
    """Judges that count their own stalls against their peers, as before issue #53: a pause
    of the whole cluster then ended every lease, which is how these schedules reached their
    bugs. The judge-stall invariant, which would stop the run at that verdict, is off."""
    monkeypatch.setattr(sim_run.Sim, "_judged", lambda self, judge, accused: None)
    with mutation.active("judge_counts_own_stall"):
        yield


def release_on_death(self, address):
    """The old rule: D ends the quarantines of a P it declares dead."""
    for q in list(self.quarantine.values()):
        if q.peer == address:
            q.until = self.clock.now()
    self._end_quarantines()
    Coordinator._peer_dead(self, address)


@pytest.mark.parametrize("seed,schedule", PAUSES)
def test_no_write_lands_after_a_pause_past_the_lease(seed, schedule):
    r = run_seed(seed, BEFORE_SPLIT, schedule=fl.from_json(schedule))
    assert r.ok, r.violation


def test_the_pause_schedules_still_reach_the_bug(monkeypatch, old_judges):
    """Without either fix, and with the judges of old, each schedule breaks no-late-write:
    they still test what they should. (Either fix alone keeps the write out of pages
    another request owns.)"""
    def unfenced(self, job):
        if job.fault is None:
            self.write_progress(job)
    monkeypatch.setattr(CommonManager, "progress_job", unfenced)
    monkeypatch.setattr(DecodeSide, "_peer_dead", release_on_death)
    for seed, schedule in PAUSES:
        r = run_seed(seed, BEFORE_SPLIT, schedule=fl.from_json(schedule))
        assert not r.ok and r.violation.invariant == "no-late-write", (seed, r.violation)


@pytest.mark.parametrize("seed,schedule", GAPS)
def test_no_write_lands_after_d_declared_a_live_p_dead(seed, schedule):
    r = run_seed(seed, BEFORE_SPLIT, schedule=fl.from_json(schedule))
    assert r.ok, r.violation


def test_the_gap_schedules_still_reach_the_bug(monkeypatch, old_judges):
    """With the old rule (a quarantine ends when D declares P dead), and the judges of old,
    each schedule breaks no-late-write: they still test what they should."""
    monkeypatch.setattr(DecodeSide, "_peer_dead", release_on_death)
    for seed, schedule in GAPS:
        r = run_seed(seed, BEFORE_SPLIT, schedule=fl.from_json(schedule))
        assert not r.ok and r.violation.invariant == "no-late-write", (seed, r.violation)


# (seed, shrunk schedule): P crashed and restarted; a room with the new P was aborted
# while D's lease still named the old incarnation
STALE_LEASE = [
    (43020, '[{"at":0.536,"kind":"crash","target":"prefill-0","duration":0.385,"params":{}},'
            '{"at":1.232,"kind":"abort","target":"r2","duration":0.0,"params":{}}]'),
]


@pytest.mark.parametrize("seed,schedule", STALE_LEASE)
def test_a_stale_lease_does_not_end_the_new_writers_quarantine(seed, schedule):
    r = run_seed(seed, BEFORE_SPLIT, schedule=fl.from_json(schedule))
    assert r.ok, r.violation


def test_the_stale_lease_schedule_still_reaches_the_bug(monkeypatch):
    """With the old test (any other incarnation on record means restarted) it breaks."""
    def any_other(self, q):
        return q.incarnation is not None and bool(self._visible(q.peer) - {q.incarnation})
    monkeypatch.setattr(DecodeSide, "_restarted", any_other)
    for seed, schedule in STALE_LEASE:
        r = run_seed(seed, BEFORE_SPLIT, schedule=fl.from_json(schedule))
        assert not r.ok and r.violation.invariant == "no-late-write", (seed, r.violation)


# (seed, schedule): P's Notice of a failed transfer went out inside a slow pass over a
# lossy link; the room ended in P's lifecycle after the link healed. The first is the
# shrunk schedule found on a fresh range; once the router's health checks changed (issue
# #53) its timings no longer line up, and the second, its link fault moved earlier (found
# by trying the fault's start and length over a grid), reaches the old verdict again.
LOST_NOTICE = [
    (20794047, '[{"at":0.109,"kind":"transfer","target":"prefill-0","duration":1.044,"params":{"fail_transfer":1.0}},'
               '{"at":0.232,"kind":"slow","target":"prefill-0","duration":4.173,"params":{"factor":50}},'
               '{"at":0.329,"kind":"disconnect","target":"r10","duration":0.0,"params":{"count":4}},'
               '{"at":0.864,"kind":"link","target":"prefill-0>decode-0","duration":0.421,'
               '"params":{"drop":0.6,"dup":0.1,"reorder":0.3,"delay":0.0}}]'),
    (20794047, '[{"at":0.109,"kind":"transfer","target":"prefill-0","duration":1.044,"params":{"fail_transfer":1.0}},'
               '{"at":0.232,"kind":"slow","target":"prefill-0","duration":4.173,"params":{"factor":50}},'
               '{"at":0.329,"kind":"disconnect","target":"r10","duration":0.0,"params":{"count":4}},'
               '{"at":0.3,"kind":"link","target":"prefill-0>decode-0","duration":0.3,'
               '"params":{"drop":0.6,"dup":0.1,"reorder":0.3,"delay":0.0}}]'),
]


@pytest.mark.parametrize("seed,schedule", LOST_NOTICE)
def test_a_notice_lost_before_the_room_ended_is_not_held_against_the_peer(seed, schedule):
    r = run_seed(seed, SimConfig(), schedule=fl.from_json(schedule))
    assert r.ok, r.violation


def test_the_lost_notice_schedule_still_reaches_the_old_verdict(monkeypatch):
    """Judged by the link's state when the room ended (the old checker), it breaks peer-end."""
    send = net.SimChannel.send

    def unrecorded(self, dst, msg, frames=()):
        ok = send(self, dst, msg, frames)
        self.network.notices.clear()
        return ok
    monkeypatch.setattr(net.SimChannel, "send", unrecorded)
    for seed, schedule in LOST_NOTICE[1:]:
        r = run_seed(seed, SimConfig(), schedule=fl.from_json(schedule))
        assert not r.ok and r.violation.invariant == "peer-end", (seed, r.violation)

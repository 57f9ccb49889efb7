"""The short version of `make chaos` (tests/chaos.py), and the regressions it found."""
from __future__ import annotations

import dataclasses

from chaos import Options, print_table, run_seeds

# Short episodes (fewer requests, one fault) on 1 prefill + 2 decode workers, for the faults no
# other test puts on real processes: 16 drops every Aux a prefill worker sends, 27 kills the
# prefill worker, and 65 (below). Seeds found earlier that other tests now cover: 0 saturated
# the small decode pool (test_scheduler.py's deadlock test), 7 killed a decode worker and 11
# froze one past the router's lease (test_cluster.py); `make chaos` still draws them.
# 65 is the regression chaos seed 39 found (2P+2D; here 1P+2D): `hang_transfer=1` on the
# prefill worker. P's write never completes, so its aux never goes out; P held the room in
# `transfer` while D listed it as `waiting`, and only the 60 s backstops ended the request.
# A pending write is now judged by progress too: with no byte handed off and none landed for
# the lease, P fails it (transfer_error) and the client is answered within the lease. D still
# quarantines the hung one-sided (shm) write's pages until --transfer-timeout +
# --quarantine-grace.
SHORT_SEEDS = [16, 27, 65]
# Every episode runs with the backstops lowered: --transfer-timeout 8 s, so seed 65's leak
# check is quick, and the router's --request-timeout 30 s, so a regression shows as a late
# answer. Both stay above every client's bound (chaos.BOUND): an answer that only a backstop
# gave is still a violation.
OPTS = Options(short=True, router_flags=("--request-timeout", "30"), worker_flags=("--transfer-timeout", "8"))


def test_short_chaos_keeps_every_invariant(tiny_llama_dir):
    results = run_seeds(SHORT_SEEDS, {s: (1, 2) for s in SHORT_SEEDS}, OPTS, model_dir=tiny_llama_dir)
    failed = [r for r in results if r["problems"]]
    if failed:
        print_table(results, 0.0, OPTS)
    assert len(results) == len(SHORT_SEEDS) and not failed, [(r["seed"], r["problems"]) for r in failed]


# As `kvrelay serve` runs them on this machine: 1 prefill + 1 decode worker sharing the cores
# (--core-share), so the decode worker waits, bounded, while the prefill worker computes a
# prompt. 2 saturates the pair with long prompts beside decodes, 20 kills the prefill worker
# in the middle of its work: a decode worker must never wait for a dead one (nor for a
# stopped one: test_core_share.py), and nothing may leak.
SHARED_SEEDS = [2, 20]


def test_short_chaos_on_shared_cores_keeps_every_invariant(tiny_llama_dir):
    opts = dataclasses.replace(OPTS, share_cores=True)
    results = run_seeds(SHARED_SEEDS, {s: (1, 1) for s in SHARED_SEEDS}, opts, model_dir=tiny_llama_dir)
    failed = [r for r in results if r["problems"]]
    if failed:
        print_table(results, 0.0, opts)
    assert len(results) == len(SHARED_SEEDS) and not failed, [(r["seed"], r["problems"]) for r in failed]

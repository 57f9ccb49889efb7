"""Helpers for the kernel tests."""
from __future__ import annotations

from typing import Callable

import torch


def assert_more_threads_than_cores_give_the_one_thread_result(run: Callable[[], list[torch.Tensor]],
                                                             threads: int = 4, repeats: int = 20) -> None:
    """`run()` on `threads` threads (more than this machine's cores: threads get preempted
    and their parts taken over, `worksteal.h`) returns, `repeats` times, what it returns on
    one thread, bit for bit."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = run()
        torch.set_num_threads(threads)
        for _ in range(repeats):
            got = run()
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert torch.equal(g, w)
    finally:
        torch.set_num_threads(before)

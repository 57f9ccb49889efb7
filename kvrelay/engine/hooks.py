"""What an engine tells the component that holds it: the hooks a disaggregated worker
core composes an `EngineCore` with, instead of overriding its methods.

Modelled on vLLM's KV connector `request_finished` (a finished request may keep its
blocks, handing them to the connector), without the rest of that interface: an owner that
needs anything else calls the engine's public methods between steps.

Contract: the engine calls every hook on its own thread, inside `EngineCore.step()`. A
hook must not add, abort or finish a request, nor touch the scheduler's queues. The
defaults do nothing, which is a colocated engine's behaviour (`EngineHooks()`).
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.engine.request import Req
    from kvrelay.engine.sampling import SampleResult
    from kvrelay.engine.scheduler import PrefillItem


@dataclass(frozen=True)
class PassProgress:
    """How far the prefill pass under way has come: its prompt chunks (each a request's
    tokens [start, start + length)) and how many of its first layers it has computed.
    Those layers' K/V for these tokens is in the pool and final (`KVPool.fence` first,
    to read it on a device that computes asynchronously)."""
    items: tuple[PrefillItem, ...]
    layers: int


class EngineHooks:
    def request_finished(self, req: Req, last: SampleResult) -> Hashable | None:
        """Choice `req` sampled `last`, its final token (stop or length; for a
        prefill-only request its first), and finishes as this returns.

        Returns the holder that keeps its pages, or None: the engine frees them with the
        request. With a holder, the engine hands every reference the choice holds to it
        (`PageAllocator.transfer`) right after this returns, before the request finishes,
        so each page keeps exactly one release path: the holder's owner frees the holder.
        The choices of a request of n > 1 are called in index order within one step;
        choice 0 alone holds the prompt's pages (the others hold shared references).
        Not called for a choice that ends by abort or error: its pages are freed with it."""
        return None

    def between_layers(self, progress: PassProgress) -> None:
        """Inside a prefill pass, after a layer, at most every `MID_STEP_PERIOD`: work that
        cannot wait for a long step's end (a worker core's heartbeats and transfer
        backend; the layers computed so far, `progress`, may be read and sent). Must not
        change the running batch or its pages; an exception is logged and the pass goes on."""

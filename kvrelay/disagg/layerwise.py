"""Layer-wise transfer: what of one room's KV a prefill worker writes to D while the
prompt is still computing, and what is left for the send at the prompt's end.

A layer's K/V for the tokens of a prefill pass is final once the pass has computed that
layer, so P can write it while the later layers compute (`KVSender.send_ahead`). The
layout is page-major (`core.kvlayout`), so layers [i, j) of a page are one byte span
(`KVLayout.layer_spans`): a write ahead is one span per page.

`LayerCursor` is pure bookkeeping, positions in the room's page list and token offsets
only. Invariants, between calls:
- pages at positions [0, final) hold every layer's final KV at D;
- pages [final, span_end) hold layers [0, layers) of the chunk being computed, tokens
  [chunk_start, chunk_end); its last page, when not full, is rewritten by the next chunk;
- nothing else was written ahead, so `finish` returns everything else: after the parts it
  returns are written, every byte of every page of the prompt is final at D.
A chunk that does not follow the last one (the prompt recomputed after a preemption)
starts the cursor over: bytes written before are rewritten later, never trusted.
"""
from __future__ import annotations

from kvrelay.core.kvlayout import KVLayout, PagePart


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class LayerCursor:
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.final = 0                     # pages [0, final) are final at D
        self.chunk: tuple[int, int] | None = None   # tokens of the chunk being written
        self.layers = 0                    # its layers [0, layers) are written

    @property
    def span_end(self) -> int:
        return _pages(self.chunk[1], self.layout.page_size) if self.chunk is not None else self.final

    def advance(self, start: int, end: int, layers: int) -> list[PagePart]:
        """A pass computing prompt tokens [start, end) has finished its first `layers`
        layers: the parts to write now."""
        if not 0 <= start < end or not 0 <= layers <= self.layout.num_layers:
            raise ValueError(f"tokens [{start}, {end}), {layers} layers")
        parts: list[PagePart] = []
        if self.chunk != (start, end):
            if self.chunk is not None and start == self.chunk[1]:
                parts += self._rest_of_chunk()
                self.final = self.chunk[1] // self.layout.page_size
            elif self.chunk is not None or start < self.final * self.layout.page_size:
                self.final = 0   # not the next chunk: start over
            first = start // self.layout.page_size
            if first > self.final:   # computed before this cursor saw them: final, whole
                parts.append(PagePart(self.final, first - self.final))
            self.final, self.chunk, self.layers = first, (start, end), 0
        if layers > self.layers:
            parts.append(PagePart(self.final, self.span_end - self.final,
                                  self.layout.layer_spans(self.layers, layers)))
            self.layers = layers
        return parts

    def finish(self, prompt_len: int, num_pages: int) -> list[PagePart]:
        """The prompt's `prompt_len` tokens are computed, in `num_pages` pages: the parts
        still to write."""
        parts = self._rest_of_chunk() if self.chunk is not None else []
        whole_from = self.final
        if self.chunk is not None:
            end = self.chunk[1]
            # the chunk's pages are final now, except a last page the prompt goes on past
            whole_from = _pages(end, self.layout.page_size) if end >= prompt_len else end // self.layout.page_size
        whole_from = min(whole_from, num_pages)
        if whole_from < num_pages:
            parts.append(PagePart(whole_from, num_pages - whole_from))
        return parts

    def _rest_of_chunk(self) -> list[PagePart]:
        """Layers [layers, num_layers) of the chunk's pages."""
        if self.layers >= self.layout.num_layers or self.span_end <= self.final:
            return []
        return [PagePart(self.final, self.span_end - self.final,
                         self.layout.layer_spans(self.layers, self.layout.num_layers))]

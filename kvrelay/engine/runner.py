"""The model runner: turns scheduled work into ForwardBatch tensors and runs the model.

`prefill` and `decode` are separate entry points (the disaggregated workers use one
each). Index tensors are built with vectorised torch ops; the only Python loop is over
the requests of the batch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from kvrelay.engine.attention import make_attention_backend
from kvrelay.engine.forward import ForwardBatch
from kvrelay.engine.kv_pool import KVPool


@dataclass(frozen=True)
class SeqChunk:
    """`tokens` are the ids at positions [start, start + len(tokens)) of a sequence whose
    KV lives in `pages`, in order (pages must cover start + len(tokens) positions)."""
    tokens: list[int]
    start: int
    pages: list[int]


def build_forward_batch(chunks: list[SeqChunk], page_size: int) -> ForwardBatch:
    q_lens = [len(c.tokens) for c in chunks]
    kv_lens = [c.start + n for c, n in zip(chunks, q_lens)]
    B, max_q = len(chunks), max(q_lens)
    max_pages = -(-max(kv_lens) // page_size)
    page_table = torch.zeros(B, max_pages, dtype=torch.long)
    for b, c in enumerate(chunks):
        n = min(len(c.pages), max_pages)
        page_table[b, :n] = torch.tensor(c.pages[:n], dtype=torch.long)
    starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
    q_len_t = torch.tensor(q_lens, dtype=torch.long)

    q_off = torch.arange(max_q)
    q_valid = q_off[None, :] < q_len_t[:, None]                       # [B, max_q]
    q_pos = starts[:, None] + q_off[None, :]                          # [B, max_q]
    row_start = torch.cumsum(q_len_t, 0) - q_len_t
    q_index = torch.where(q_valid, row_start[:, None] + q_off[None, :], torch.zeros_like(q_pos))

    positions = q_pos[q_valid]                                        # [T] in row order
    rows_b = torch.arange(B)[:, None].expand(B, max_q)[q_valid]
    write_pages = page_table[rows_b, positions // page_size]
    write_offsets = positions % page_size

    flat_ids = [t for c in chunks for t in c.tokens]
    return ForwardBatch(
        input_ids=torch.tensor(flat_ids, dtype=torch.long),
        positions=positions,
        q_lens=q_lens,
        kv_lens=kv_lens,
        write_pages=write_pages,
        write_offsets=write_offsets,
        page_table=page_table,
        kv_page_size=page_size,
        q_index=q_index,
        q_valid=q_valid,
        logits_index=row_start + q_len_t - 1,
        no_prefix=all(c.start == 0 for c in chunks),
    )


class Runner(ABC):
    """What the engine computes a step with (`LoadedModel.make_runner(model, kv)`).

    - `prefill(chunks)` writes each chunk's tokens into the pool pages it names and returns
      float32 logits [B, vocab] of each chunk's last token.
    - `decode(last_tokens, positions, pages)` does the same for one token per sequence.
    - `between_layers` is set by the engine (None for nothing): a runner may call it inside
      a `prefill` pass after a layer, with the number of layers done. A runner whose
      `CALLS_BETWEEN_LAYERS` is True calls it after each layer as the pass's time goes by,
      so that one long pass can heartbeat and answer reads (a worker may then take long
      steps); `decode` never does (one decode step is shorter than any lease).
    """
    CALLS_BETWEEN_LAYERS = False
    between_layers: Callable[[int], None] | None = None   # gets the layers done so far

    @abstractmethod
    def prefill(self, chunks: list[SeqChunk]) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, last_tokens: list[int], positions: list[int], pages: list[list[int]]) -> torch.Tensor: ...


class ModelRunner(Runner):
    CALLS_BETWEEN_LAYERS = True

    def __init__(self, model: torch.nn.Module, kv: KVPool, attention: str = "auto") -> None:
        self.model = model
        self.kv = kv
        self.page_size = kv.layout.page_size
        self.attention = make_attention_backend(attention, kv, model.arch.num_heads)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """float32 logits [B, vocab] of the last token of each chunk."""
        batch = build_forward_batch(chunks, self.page_size)
        if self.kv.device.type != "cpu":   # the index tensors go where the model and the pool are
            batch = batch.to(self.kv.device)
        return self.model(batch, self.attention, after_layer)

    def prefill(self, chunks: list[SeqChunk]) -> torch.Tensor:
        return self.forward(chunks, self.between_layers)

    def decode(self, last_tokens: list[int], positions: list[int], pages: list[list[int]]) -> torch.Tensor:
        return self.forward([SeqChunk([t], p, pg) for t, p, pg in zip(last_tokens, positions, pages)])

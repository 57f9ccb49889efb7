"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE: one character may span several
tokens, and decoding a prefix of them yields U+FFFD. We keep two offsets into the token
list (the prefix/read-offset technique):

    ids[prefix_offset:read_offset]   already emitted; decoded again only as context
    ids[read_offset:]                not yet emitted

and emit `decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])` once
it no longer ends in U+FFFD. Decoding from a few tokens back (not from the start) keeps
each step O(1) and still gives context-sensitive decoders (SentencePiece's leading
space) the token before. Invariant: `prefix_offset` and `read_offset` sit on character
boundaries, so the concatenation of everything emitted equals decoding all output ids.

Stop strings are matched on the text. Text that could be the beginning of a stop string
is held back until the next token settles it; a matched stop string and everything after
it is never emitted.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5   # prompt tokens decoded as context for the first output token


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending = ""           # decoded, not yet emitted: may start a stop string
        self._emitted: list[str] = []
        self.matched_stop: str | None = None   # the stop string that ended the text

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    @property
    def stopped(self) -> bool:
        return self.matched_stop is not None

    def add(self, token_ids: list[int], armed: bool = True) -> tuple[str, bool]:
        """Feed new tokens; returns (newly final text, whether a stop string was hit).
        After a stop every call returns ("", True). `armed` False (the request has not yet
        generated `min_tokens`): no stop string is looked for and nothing is held back, so a
        stop string counts only within text decoded once the stops are armed (vLLM's rule)."""
        if self.stopped:
            return "", True
        for tid in token_ids:
            self._ids.append(tid)
            self._pending += self._decode_step()
        if not armed:
            out, self._pending = self._pending, ""
            if out:
                self._emitted.append(out)
            return out, False
        return self._release(final=False)

    def flush(self) -> str:
        """The request ended for another reason: emit whatever is held back, including an
        incomplete character as U+FFFD (it will never be completed)."""
        if self.stopped:
            return ""
        self._pending += self._decode_tail()
        self._prefix_offset = self._read_offset = len(self._ids)
        text, _ = self._release(final=True)
        return text

    # -- tokens -> text ---------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special,
                                clean_up_tokenization_spaces=False)

    def _decode_tail(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        return full[len(prefix):]

    def _decode_step(self) -> str:
        new_text = self._decode_tail()
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):
            return ""   # an incomplete character (or nothing visible yet): wait for more
        # drop ids before the new prefix: the list stays a few tokens long
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text

    # -- stop strings -----------------------------------------------------------------

    def _release(self, final: bool) -> tuple[str, bool]:
        """Move the part of `_pending` that is settled into the emitted text."""
        cut = self._find_stop()
        if cut is not None:
            out = self._pending[:cut]
            self._pending = ""
        else:
            keep = 0 if final else self._stop_prefix_len()
            split = len(self._pending) - keep
            out, self._pending = self._pending[:split], self._pending[split:]
        if out:
            self._emitted.append(out)
        return out, self.stopped

    def _find_stop(self) -> int | None:
        """Index in `_pending` of the earliest stop string, recording which one.
        Searching `_pending` suffices: emitted text never ends with a stop prefix."""
        best: int | None = None
        for s in self._stop:
            i = self._pending.find(s)
            if i >= 0 and (best is None or i < best):
                best, self.matched_stop = i, s
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of `_pending` that is a proper prefix of a stop."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(s[:n]):
                    longest = n
                    break
        return longest

"""The front door's tokenizer work, off its event loop.

A prompt is untrusted input whose cost grows with its length: tokenizing 4 MB of text
takes seconds, and on the event loop it would stall every stream the process serves and
every lease it keeps (lifecycle.md, invariant 8).

Invariants:
- No tokenizer runs on the event loop. Encoding, decoding and chat-template rendering run
  in a pool of TOKENIZER_THREADS threads, each with its own copy of the tokenizer (one
  Hugging Face tokenizer is not safe to share between threads); callers await them, and
  a caller that gives up leaves its queued work to be skipped.
- Text longer than `max_chars` cannot fit the context and is refused before any tokenizer
  sees it, in constant time: no token of the vocabulary spells more than `longest`
  characters, so a text of more than `max_model_len * longest` characters has more than
  `max_model_len` tokens. (A normalizer that drops characters, as BERT's does with
  whitespace, could shrink a text below that; the causal LMs served here keep every
  character.)
"""
from __future__ import annotations

import asyncio
import copy
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from kvrelay.server.errors import invalid, is_text

TOKENIZER_THREADS = 2


def longest_token(tok) -> int:
    """The most characters one token of `tok` spells (its vocabulary and added tokens)."""
    pieces = list(tok.get_vocab())
    pieces += [str(t) for t in getattr(tok, "added_tokens_decoder", {}).values()]
    return max((len(p) for p in pieces), default=1) or 1


class Tokenizing:
    """`tok`'s work for one server: `encode`, `decode` and `render` (a chat template),
    each awaited while a pool thread runs it on its own copy of `tok`."""

    def __init__(self, tok, max_model_len: int, threads: int = TOKENIZER_THREADS) -> None:
        self.tok = tok
        self.max_model_len = max_model_len
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvrelay-tokenizer")

    @functools.cached_property
    def longest(self) -> int:
        return longest_token(self.tok)

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.longest

    def _own(self):
        """This pool thread's copy of the tokenizer."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            tok = self._local.tok = copy.deepcopy(self.tok)
        return tok

    async def _run(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self._pool.submit(lambda: fn(self._own())))

    def check_length(self, chars: int, param: str) -> None:
        """Refuse `chars` characters of prompt text that cannot fit the context."""
        if chars > self.max_chars:
            raise invalid(f"This model's maximum context length is {self.max_model_len} tokens, and the {param} "
                          f"holds {chars} characters: more than the {self.max_chars} that many tokens can spell "
                          f"(no token of this model spells more than {self.longest}); shorten the {param}.",
                          param, "context_length_exceeded")

    async def encode(self, text: object, param: str, **kwargs) -> list[int]:
        """Token ids of `text`. Refuses text that is not valid Unicode (a rendered chat
        template holds more than the fields: whatever it holds must be text, too), or too
        long to fit, before the tokenizer."""
        if not isinstance(text, str):
            raise invalid(f"{param}: must be valid Unicode text", param, "invalid_text")
        self.check_length(len(text), param)
        if not is_text(text):
            raise invalid(f"{param}: must be valid Unicode text", param, "invalid_text")
        return await self._run(lambda tok: tok.encode(text, **kwargs))

    async def decode(self, ids: list[int]) -> str:
        return await self._run(lambda tok: tok.decode(ids))

    async def pieces(self, ids: list[int]) -> list[str]:
        """The text of each token of `ids` on its own."""
        return await self._run(lambda tok: [tok.decode([t]) for t in ids])

    async def render(self, messages: list[dict], **kwargs) -> str:
        """The chat template applied to `messages` (as text, not tokenized)."""
        return await self._run(lambda tok: tok.apply_chat_template(messages, tokenize=False, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

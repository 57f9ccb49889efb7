"""A GGUF file's tokenizer, converted once and kept on disk.

transformers turns a GGUF vocabulary into a fast tokenizer at every process start: the
router's and every worker's (SmolLM2's 49k tokens: about 3-4 s of CPU on a small machine).
The converted tokenizer is saved under the cache directory, keyed by the file (resolved
path, size, modification time) and the transformers and tokenizers versions; later starts
load it in a fraction of a second, the same tokenizer (tests/test_loader.py compares them).

The cache only saves time. A directory that cannot be written or an entry that cannot be
read means converting as before. An entry is written whole or not at all: saved into a
temporary directory, then renamed into place (a second process storing the same entry at
the same time keeps the first one).

It lives in kvrelay's cache directory (kvrelay/core/cache.py), under gguf-tokenizers/.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

from kvrelay.core.cache import cache_root

log = logging.getLogger("kvrelay.engine")
T = TypeVar("T")


def entry_for(path: Path, stamp: tuple[int, int]) -> Path:
    """Where the tokenizer of GGUF file `path` (with `stamp` = (size, mtime_ns)) is kept."""
    import tokenizers
    import transformers
    key = f"{path.resolve()}|{stamp[0]}|{stamp[1]}|{transformers.__version__}|{tokenizers.__version__}"
    return cache_root() / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def load_or_convert(path: Path, stamp: tuple[int, int], convert: Callable[[], T]) -> T:
    """The cached tokenizer of `path` if there is a readable one, else `convert()`, stored
    for the next start."""
    entry = entry_for(path, stamp)
    if (entry / "tokenizer.json").is_file():
        try:
            import transformers
            return transformers.PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True)
        except Exception as e:   # a damaged entry: convert, and replace it
            log.warning("tokenizer cache entry unreadable; converting again",
                        extra={"entry": str(entry), "error": f"{type(e).__name__}: {e}"})
            shutil.rmtree(entry, ignore_errors=True)
    tok = convert()
    _store(tok, entry)
    return tok


def _store(tok, entry: Path) -> None:
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".partial-", dir=entry.parent)
        tok.save_pretrained(tmp)
        os.replace(tmp, entry)   # OSError if another process stored it first: theirs stands
        tmp = None
    except Exception as e:   # an unwritable directory, a full disk: the next start converts again
        log.debug("tokenizer not cached", extra={"entry": str(entry), "error": f"{type(e).__name__}: {e}"})
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

"""kvrelay's directory for what it builds once and reuses across starts (compiled kernels,
converted tokenizers): $KVRELAY_CACHE, else $XDG_CACHE_HOME/kvrelay, else ~/.cache/kvrelay."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("KVRELAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvrelay")
    return Path(base)

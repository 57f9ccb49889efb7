"""Every random identifier kvrelay draws: room ids, epochs, incarnations, default sampling
seeds. In production they come from the OS's CSPRNG, so nobody can guess the next room or
epoch from the last; the deterministic simulation (`kvrelay.sim`) swaps in a seeded source
so that one seed replays one run exactly. Nothing else may draw identifiers."""
from __future__ import annotations

import random
import secrets

_source: random.Random = secrets.SystemRandom()


def randbits(k: int) -> int:
    return _source.getrandbits(k)


def randbelow(n: int) -> int:
    return _source.randrange(n)


def token_hex(nbytes: int) -> str:
    return _source.getrandbits(nbytes * 8).to_bytes(nbytes, "big").hex()


def use(source: random.Random | None) -> None:
    """Draw from `source` from now on (None: the OS's CSPRNG again). Only the simulation
    calls this; a seeded source makes identifiers guessable."""
    global _source
    _source = source if source is not None else secrets.SystemRandom()

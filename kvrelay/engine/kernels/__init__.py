"""Native kernels, compiled on first use with the machine's C compiler (`cc`, -O3
-march=native) into a per-user cache, and loaded with ctypes. Everything here has a
pure-torch fallback: when no compiler is found, the build fails, or KVRELAY_NATIVE=0,
`paged_decode()` returns None and the model uses torch ops instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("kvrelay.kernels")
SOURCE = Path(__file__).with_name("paged_attention.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-shared", "-fopenmp"]
_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def cache_dir() -> Path:
    base = os.environ.get("KVRELAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvrelay")
    return Path(base) / "kernels"


def _build() -> Path | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: decode attention uses the torch fallback")
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_attention-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        log.warning("building the native decode kernel failed; using the torch fallback:\n%s", proc.stderr)
        return None
    os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    return target


class PagedDecode:
    """`__call__` computes one layer's decode attention from the pool (see the C source for
    the layout). It reads keys and values once, in place, on torch's own OpenMP threads,
    where the torch path gathers every page into a new tensor and reads it again."""

    head_dims = (64, 128)
    max_group = 16

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.bfloat16: lib.paged_decode_bf16, torch.float32: lib.paged_decode_f32}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _I64]

    def supports(self, dtype: torch.dtype, head_dim: int, group: int) -> bool:
        return dtype in self._fns and head_dim in self.head_dims and group <= self.max_group

    def __call__(self, pool: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor, q: torch.Tensor,
                 layer: int, num_kv_heads: int, page_size: int, scale: float) -> torch.Tensor:
        """pool [pages, L, 2, H, S, D]; page_table [B, P] int64; kv_lens [B] int64;
        q [B, Hq, D] in the pool's dtype -> out [B, Hq, D]."""
        B, Hq, D = q.shape
        L, H = pool.shape[1], num_kv_heads
        q = q.contiguous()
        out = torch.empty_like(q)
        rc = self._fns[pool.dtype](pool.data_ptr(), page_table.data_ptr(), kv_lens.data_ptr(), q.data_ptr(),
                                   out.data_ptr(), page_table.shape[1], layer, L, H, Hq // H, page_size, D,
                                   scale, 0, B * H)
        if rc != 0:
            raise RuntimeError(f"native decode attention failed ({rc}): out of memory or unsupported shape")
        return out


@lru_cache(maxsize=1)
def paged_decode() -> PagedDecode | None:
    if os.environ.get("KVRELAY_NATIVE", "1") == "0":
        return None
    try:
        path = _build()
        return PagedDecode(ctypes.CDLL(str(path))) if path else None
    except OSError as exc:
        log.warning("loading the native decode kernel failed (%s); using the torch fallback", exc)
        return None

"""A lean GGUF reader: metadata scalars and tensor locations from the header, tensors
dequantized on demand by `gguf.quants.dequantize`.

Why not `gguf.GGUFReader`: it materialises every metadata array as numpy views, which for
a 49k-token vocabulary takes seconds; the model needs only the scalars (the tokenizer is
read by transformers). Layout (GGUF v2/v3, little-endian): magic, version u32, tensor
count u64, metadata count u64, metadata (key string, type u32, value), tensor infos (name,
n_dims u32, dims u64 x n_dims innermost first, ggml type u32, offset u64), padding to
`general.alignment`, tensor data.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

# metadata value type id -> struct format; 8 (string) and 9 (array) are read by hand
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file (wrong magic, truncated, bad type)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: int           # ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # numpy order: outermost first (GGUF stores innermost first)
    start: int           # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"header ends early at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"string at byte {self.pos} runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        """A scalar or string; an array is skipped and returned as its length (not needed)."""
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[etype])
            else:
                for _ in range(count):
                    self.value(etype)
            return count
        raise GGUFFormatError(f"unknown metadata value type {vtype} at byte {self.pos}")


class GGUFFile:
    """`metadata` maps keys to scalars/strings (arrays: their length); `tensors` in file order."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        if len(self._map) < 24 or bytes(self._map[:4]) != b"GGUF":
            raise GGUFFormatError("no GGUF magic at the start of the file")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("<I"))
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // align) * align
        self.tensors = [TensorInfo(n, q, s, data_start + off, nb) for n, q, s, off, nb in infos]
        for t in self.tensors:
            if t.start + t.nbytes > len(self._map):
                raise GGUFFormatError(f"tensor {t.name} runs past the end of the file (truncated?)")

    @staticmethod
    def _tensor_info(cur: _Cursor):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        qtype, offset = cur.take("<I"), cur.take("<Q")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name} has unknown ggml type {qtype}") from None
        if dims[0] % block:
            raise GGUFFormatError(f"tensor {name}: row of {dims[0]} is not whole blocks of {block}")
        return name, qtype, tuple(reversed(dims)), offset, prod(dims) // block * type_size

    def blocks(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as stored, uint8 [rows, bytes per row] (a fresh copy)."""
        rows = prod(t.shape[:-1])
        return np.array(self._map[t.start:t.start + t.nbytes]).reshape(rows, t.nbytes // rows)

    def read(self, t: TensorInfo) -> np.ndarray:
        """The tensor as float32, shape `t.shape` (a fresh, writable array)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize
        raw = self._map[t.start:t.start + t.nbytes]
        rows = prod(t.shape[:-1])
        out = dequantize(raw.reshape(rows, -1), GGMLQuantizationType(t.qtype))
        if out.dtype != np.float32 or not out.flags.writeable:  # F32 comes back as a file view
            out = out.astype(np.float32)
        return out.reshape(t.shape)

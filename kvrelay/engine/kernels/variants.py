"""Which native kernel variant runs on this CPU.

Every kernel source is compiled once per variant, with that variant's instruction-set
flags and never `-march=native`, into its own shared library in a per-user cache. The CPU's
features are read with cpuid (`cpu_features.c`, built without any instruction-set flag),
and the best variant whose features are all present is loaded. A CPU with none of them,
no GCC (`_compiler`), a failed build or `KVRELAY_NATIVE=0` runs the torch fallbacks ("torch").

Invariants:
- a variant is loaded only when `missing(variant)` is empty: a forced variant the CPU
  lacks raises `IsaUnavailable` naming the missing features, it never loads and crashes;
- every factory that wraps the library is `@per_isa`, so `select_isa` drops every wrapper
  built for the previous variant at once (packed weights are per variant: rebuild models).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Callable, TypeVar

from kvrelay.core.cache import cache_root

log = logging.getLogger("kvrelay.kernels")
HERE = Path(__file__).parent
RECIPE = "compile, then link without -ffast-math"   # part of the cache key: a new recipe rebuilds
COMMON_FLAGS = ("-O3", "-ffast-math", "-fPIC", "-shared", "-fopenmp")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd", "-mavx512vnni",
           "-mfma", "-mf16c", "-mbmi2")
# Best first. Flags per variant, and the cpuid features each needs (FEATURE_NAMES).
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512_bf16": (*_AVX512, "-mavx512bf16"),
    "avx512_vnni": _AVX512,
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mbmi2"),
}
_AVX512_FEATURES = frozenset({"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_vnni",
                              "fma", "f16c", "bmi2", "avx2"})
REQUIRES: dict[str, frozenset[str]] = {
    "avx512_bf16": _AVX512_FEATURES | {"avx512_bf16"},
    "avx512_vnni": _AVX512_FEATURES,
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi2"}),
}
TORCH = "torch"
CHOICES = ("auto", *VARIANT_FLAGS, TORCH)
FEATURE_NAMES = ("fma", "f16c", "avx2", "bmi2", "avx_vnni", "avx512f", "avx512dq", "avx512cd", "avx512bw",
                 "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# The sources every variant library is built from; kernel modules add theirs here.
SOURCES: list[Path] = [HERE / n for n in ("paged_attention.c", "elementwise.c", "gemm_bf16.c", "gemm_amx.c",
                                          "gemm_wide.c", "gemm_quant.c", "paged_attention_q8.c",
                                          "prefill_attention_amx.c", "kv8_store.c")]


class IsaUnavailable(ValueError):
    """A forced kernel variant this CPU (or this build) cannot run."""


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _is_gcc(cc: str) -> bool:
    """Whether `cc` is GCC (clang defines __GNUC__ too, and __clang__)."""
    try:
        proc = subprocess.run([cc, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    macros = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}
    return proc.returncode == 0 and "__GNUC__" in macros and not macros & {"__clang__", "__INTEL_COMPILER"}


@lru_cache(maxsize=1)
def _compiler() -> str | None:
    """The first GCC among $CC, gcc and cc. The kernels run inside torch's OpenMP team,
    which is GCC's runtime (libgomp): clang's -fopenmp emits calls to LLVM's runtime, whose
    second team of threads would spin beside torch's on the same cores, and which ignores
    torch.set_num_threads. None (and the reason logged) when there is no GCC."""
    named = os.environ.get("CC")
    found = [p for p in dict.fromkeys(shutil.which(c) for c in (named, "gcc", "cc") if c) if p]
    for cc in found:
        if _is_gcc(cc):
            if named and shutil.which(named) != cc:
                log.info("CC=%s is not GCC: building the kernels with %s (they share torch's OpenMP runtime, "
                         "libgomp)", named, cc)
            return cc
    log.warning("no GCC found%s: the native kernels share torch's OpenMP runtime (libgomp), which only GCC "
                "targets; install gcc for them. Using the torch fallbacks",
                f" (only {', '.join(found)})" if found else "")
    return None


def _compile(name: str, sources: list[Path], flags: tuple[str, ...]) -> Path | None:
    """The shared library built from `sources` with `flags`, cached by content; None if it
    cannot be built (the reason is logged once)."""
    cc = _compiler()
    if cc is None:
        return None
    headers = sorted(HERE.glob("*.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [*sources, *headers])
                            + " ".join([cc, *flags, RECIPE]).encode()).hexdigest()[:16]
    target = cache_dir() / f"kvrelay-{name}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    # Compiled with `flags`, linked without them: gcc links crtfastmath.o into anything
    # linked with -ffast-math, even a shared library, and its constructor would switch on
    # flush-to-zero for the whole process when the library loads.
    compile_flags = tuple(f for f in flags if f != "-shared")
    link_flags = ("-shared", *(f for f in flags if f == "-fopenmp"))
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = [os.path.join(work, f"{i}.o") for i in range(len(sources))]
        steps = [[cc, *compile_flags, "-c", "-o", o, str(src)] for o, src in zip(objects, sources)]
        steps.append([cc, *link_flags, "-o", tmp, *objects, "-lm"])
        for step in steps:
            proc = subprocess.run(step, capture_output=True, text=True)
            if proc.returncode != 0:
                os.unlink(tmp)
                log.warning("building the %s kernels failed:\n%s", name, proc.stderr[-4000:])
                return None
    os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    return target


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The features cpuid reports (and the OS enables); empty off x86-64 or without a compiler."""
    path = _compile("cpu-features", [HERE / "cpu_features.c"], ("-O2", "-fPIC", "-shared"))
    if path is None:
        return frozenset()
    fn = ctypes.CDLL(str(path)).kvrelay_cpu_features
    fn.restype, fn.argtypes = ctypes.c_int64, []
    bits = fn()
    return frozenset(n for i, n in enumerate(FEATURE_NAMES) if bits >> i & 1)


def missing(variant: str) -> frozenset[str]:
    """The features `variant` needs that this CPU lacks (empty: it can run)."""
    return REQUIRES[variant] - cpu_features() if variant in REQUIRES else frozenset()


def available_isas() -> tuple[str, ...]:
    """Variants this CPU can run, best first, then "torch"."""
    return (*(v for v in VARIANT_FLAGS if not missing(v)), TORCH)


_lock = threading.Lock()
_chosen: str | None = None
_fallback: str | None = None   # fallback_reason()
_libs: dict[str, ctypes.CDLL | None] = {}
_factories: list[Callable] = []
T = TypeVar("T")


def requested() -> str:
    """The variant the environment asks for: KVRELAY_ISA (default auto); KVRELAY_NATIVE=0
    is "torch"."""
    if os.environ.get("KVRELAY_NATIVE", "1") == "0":
        return TORCH
    return os.environ.get("KVRELAY_ISA", "auto") or "auto"


def _load(variant: str) -> ctypes.CDLL | None:
    if variant not in _libs:
        path = _compile(variant, SOURCES, (*COMMON_FLAGS, *VARIANT_FLAGS[variant]))
        try:
            _libs[variant] = ctypes.CDLL(str(path)) if path else None
        except OSError as exc:
            log.warning("loading the %s kernels failed (%s)", variant, exc)
            _libs[variant] = None
    return _libs[variant]


def _resolve(name: str) -> str:
    if name not in CHOICES:
        raise IsaUnavailable(f"unknown kernel variant {name!r}; choose one of {', '.join(CHOICES)}")
    if name == TORCH:
        return TORCH
    if name == "auto":
        for variant in available_isas()[:-1]:
            if _load(variant) is not None:
                return variant
        return TORCH
    lacks = missing(name)
    if lacks:
        raise IsaUnavailable(f"--kernels {name}: this CPU lacks {', '.join(sorted(lacks))}; "
                             f"it can run {', '.join(available_isas())}")
    if _load(name) is None:
        raise IsaUnavailable(f"--kernels {name}: the kernels could not be built (see the log); "
                             "use --kernels torch or install gcc")
    return name


def fallback_reason() -> str | None:
    """Why the torch fallbacks run where `auto` chose them, in a few words a start-up line
    can carry; None when a native variant runs or torch was asked for."""
    return _fallback


def _torch_reason() -> str:
    if _compiler() is None:
        return "no GCC found: install gcc for the native kernels"
    if not cpu_features():
        return "this CPU's features could not be read (see the log)"
    if len(available_isas()) == 1:
        return "this CPU has neither AVX2 with FMA nor AVX-512"
    return "the native kernels failed to build (see the log)"


def select_isa(name: str) -> str:
    """Switch the variant every kernel factory returns from now on ("auto": the best this
    CPU runs). Returns the variant chosen. Models built before keep their packed weights:
    build them again after switching."""
    global _chosen, _fallback
    with _lock:
        chosen = _resolve(name)
        _fallback = _torch_reason() if name == "auto" and chosen == TORCH else None
        if chosen != _chosen:
            _chosen = chosen
            for factory in _factories:
                factory.cache_clear()
        return chosen


def isa() -> str:
    """The variant in use: chosen on first use from KVRELAY_ISA (default auto)."""
    if _chosen is None:
        select_isa(requested())
    return _chosen  # type: ignore[return-value]


def native_library() -> ctypes.CDLL | None:
    variant = isa()
    return None if variant == TORCH else _libs[variant]


def per_isa(factory: Callable[[], T]) -> Callable[[], T]:
    """Cache a zero-argument wrapper factory until the variant changes."""
    cached = lru_cache(maxsize=1)(factory)
    _factories.append(cached)
    return cached

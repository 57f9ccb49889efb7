"""Runtime choice of the native kernel variant (kernels/variants.py): cpuid agrees with the
kernel's own report, every variant this CPU runs can be forced, a variant it lacks is
refused by name (never loaded, never skipped), and --dtype auto follows the variant."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from kvrelay.core.config import ModelOptions
from kvrelay.engine import attention, kernels
from kvrelay.engine.kernels import variants as isa_mod
from kvrelay.engine.loader import load_model
from kvrelay.engine.models.base import ModelLoadError
from kvrelay.server.startup import startup_line

AVX2_ONLY = frozenset({"fma", "f16c", "avx2", "bmi2"})


@pytest.fixture(autouse=True)
def back_to_auto():
    yield
    kernels.select_isa("auto")


def _linux_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("/proc/cpuinfo has no flags line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/cpuinfo is Linux's")
def test_cpuid_agrees_with_the_kernels_flags_in_proc_cpuinfo():
    # /proc/cpuinfo uses the same names; it is an independent reading of the same cpuid bits.
    expected = {name for name in isa_mod.FEATURE_NAMES if name in _linux_flags()}
    assert kernels.cpu_features() == expected


def test_available_variants_are_exactly_those_whose_features_are_all_present():
    feats = kernels.cpu_features()
    runnable = [v for v, need in isa_mod.REQUIRES.items() if need <= feats]
    assert kernels.available_isas() == (*runnable, "torch")
    assert kernels.isa() == (runnable[0] if runnable else "torch")   # auto: the best


@pytest.mark.parametrize("variant", [*isa_mod.VARIANT_FLAGS, "torch"])
def test_every_variant_is_forced_or_refused_by_name(variant):
    lacks = kernels.missing(variant)
    if lacks:
        with pytest.raises(kernels.IsaUnavailable, match="lacks " + sorted(lacks)[0]):
            kernels.select_isa(variant)
        return
    assert kernels.select_isa(variant) == variant == kernels.isa()
    if variant == "torch":
        assert kernels.native_library() is None
        assert kernels.elementwise() is None and kernels.paged_decode() is None and kernels.gemm() is None
    else:
        assert kernels.native_library() is not None
        assert kernels.elementwise() is not None and kernels.paged_decode() is not None
        # the bf16 dot-product matmul exists only where the CPU has the instruction
        assert (kernels.gemm() is not None) == (variant == "avx512_bf16")


def test_a_cpu_without_avx512_is_offered_avx2_and_refused_the_rest(monkeypatch):
    monkeypatch.setattr(isa_mod, "cpu_features", lambda: AVX2_ONLY)
    assert kernels.available_isas() == ("avx2", "torch")
    assert kernels.select_isa("auto") == "avx2"
    with pytest.raises(kernels.IsaUnavailable) as err:
        kernels.select_isa("avx512_bf16")
    assert "avx512_bf16" in str(err.value) and "avx512f" in str(err.value) and "avx2, torch" in str(err.value)
    assert kernels.isa() == "avx2"   # a refused switch changes nothing


def test_a_cpu_with_none_of_them_runs_the_torch_fallbacks(monkeypatch):
    monkeypatch.setattr(isa_mod, "cpu_features", lambda: frozenset({"fma"}))
    assert kernels.available_isas() == ("torch",)
    assert kernels.select_isa("auto") == "torch" and kernels.elementwise() is None
    assert kernels.fallback_reason() == "this CPU has neither AVX2 with FMA nor AVX-512"
    assert kernels.select_isa("torch") == "torch" and kernels.fallback_reason() is None   # asked for: no reason


def test_environment_names_the_variant_auto_means(monkeypatch):
    monkeypatch.setenv("KVRELAY_ISA", "avx2")
    assert kernels.requested() == "avx2"
    monkeypatch.setenv("KVRELAY_NATIVE", "0")
    assert kernels.requested() == "torch"


def test_unknown_variant_is_refused_with_the_choices():
    with pytest.raises(kernels.IsaUnavailable, match="avx512_bf16, avx512_vnni, avx2, torch"):
        kernels.select_isa("sse2")


@pytest.fixture
def compilers(tmp_path, monkeypatch):
    """A bin folder holding a fake clang (it answers -dM -E as clang does and builds
    nothing), searched first; the compiler choice is made afresh."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    clang = bin_dir / "clang"
    clang.write_text("#!/bin/sh\n[ \"$1\" = -dM ] && printf '#define __GNUC__ 4\\n#define __clang__ 1\\n' && exit 0\n"
                     "echo 'clang: no omp.h' >&2; exit 1\n")
    clang.chmod(0o755)
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    isa_mod._compiler.cache_clear()
    yield bin_dir
    isa_mod._compiler.cache_clear()


def test_kernels_are_built_with_gcc_even_where_cc_names_clang(compilers, monkeypatch, caplog):
    """clang's OpenMP is another runtime than torch's libgomp: with CC=clang and GCC on the
    PATH, GCC builds the kernels (and the log says why)."""
    gcc = isa_mod.shutil.which("gcc")
    assert gcc is not None and isa_mod._is_gcc(gcc), "GCC is part of the supported setup"
    assert not isa_mod._is_gcc(str(compilers / "clang"))
    monkeypatch.setenv("PATH", f"{compilers}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CC", "clang")
    with caplog.at_level("INFO", logger="kvrelay.kernels"):
        assert isa_mod._compiler() == gcc
    assert "CC=clang is not GCC" in caplog.text
    built = isa_mod._compile("cpu-features", [isa_mod.HERE / "cpu_features.c"], ("-O2", "-fPIC", "-shared"))
    assert built is not None and built.exists() and str(built).startswith(str(compilers.parent / "cache"))


def test_without_gcc_the_torch_fallbacks_run_and_the_log_says_to_install_it(compilers, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(compilers))   # the fake clang alone
    monkeypatch.setenv("CC", "clang")
    with caplog.at_level("WARNING", logger="kvrelay.kernels"):
        assert isa_mod._compiler() is None
        assert isa_mod._compile("cpu-features", [isa_mod.HERE / "cpu_features.c"], ("-O2", "-fPIC", "-shared")) is None
    assert "no GCC found (only " in caplog.text and "install gcc" in caplog.text
    assert not (compilers.parent / "cache").exists() or not any((compilers.parent / "cache").rglob("*.so"))
    monkeypatch.setattr(isa_mod, "_libs", {})   # nothing built before in this process either
    assert kernels.select_isa("auto") == "torch"
    note = kernels.fallback_reason()
    assert note == "no GCC found: install gcc for the native kernels"
    info = {"device": "cpu", "kernels": "torch", "dtype": "float32", "weights": "bf16", "kv_cache": "bfloat16",
            "attention": "torch_ref"}
    assert f"kernels torch ({note})," in startup_line("colocated", info, "m", 64, "http://x", note)


def _tiny(tiny_llama_dir, **kw):
    return load_model(ModelOptions(model=f"random:{tiny_llama_dir}", seed=0, **kw))


def test_load_refuses_a_variant_the_cpu_lacks_in_one_line(monkeypatch, tiny_llama_dir):
    monkeypatch.setattr(isa_mod, "cpu_features", lambda: AVX2_ONLY)
    with pytest.raises(ModelLoadError) as err:
        _tiny(tiny_llama_dir, kernels="avx512_vnni")
    assert "\n" not in str(err.value) and "--kernels avx512_vnni" in str(err.value)


@pytest.mark.parametrize("variant", [*isa_mod.VARIANT_FLAGS, "torch"])
def test_dtype_auto_is_bfloat16_only_where_the_cpu_computes_it(tiny_llama_dir, variant):
    if kernels.missing(variant):
        with pytest.raises(ModelLoadError, match="lacks"):
            _tiny(tiny_llama_dir, kernels=variant)
        return
    loaded = _tiny(tiny_llama_dir, kernels=variant)
    native_bf16 = variant == "avx512_bf16"
    dtype = "bfloat16" if native_bf16 else "float32"
    tiles = "amx_bf16" if native_bf16 and "amx_bf16" in kernels.cpu_features() else "none"
    assert loaded.compute_info() == {"device": "cpu", "kernels": variant, "tiles": tiles, "dtype": dtype,
                                     "weights": "same" if native_bf16 else "bf16", "kv_cache": "bfloat16",
                                     "attention": attention.resolve("auto", "cpu", getattr(torch, dtype))}
    if not os.environ.get(attention.ENV):   # --kernels torch runs no native attention either
        assert loaded.attention_backend == ("torch_ref" if variant == "torch" else "cpu_native")
    line = startup_line("colocated", loaded.compute_info(), loaded.name, 64, "http://x")
    assert f"kernels {variant}" in line and "KV cache bfloat16" in line
    assert ("matmuls on amx_bf16 tiles" in line) == (tiles == "amx_bf16")
    explicit = _tiny(tiny_llama_dir, kernels=variant, dtype="float32")
    assert explicit.compute_info()["weights"] == "same" and explicit.compute_info()["kv_cache"] == "float32"


def test_health_reports_what_computes(tiny_engine):
    from api_helpers import serving
    from kvrelay.server.colocated import colocated_app

    import httpx
    with serving(colocated_app(tiny_engine)) as url:
        health = httpx.get(f"{url}/health", timeout=30).json()
    assert health == {"status": "ok", **tiny_engine.core.loaded.compute_info(), "kv_cache": "float32"}
    assert health["kernels"] == kernels.isa() and health["dtype"] == "float32"

"""Model loading: every source (default GGUF, .gguf path, HF directory, sharded, random:)
and every user error (unknown architecture, missing or damaged files) as a ModelLoadError."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.core.config import DEFAULT_MODEL, ModelOptions
from kvrelay.engine.loader import ModelLoadError, default_gguf_path, load_model
from kvrelay.engine.models.testing import make_tiny_model_dir


def load(model: str, **kw):
    return load_model(ModelOptions(model=model, dtype=kw.pop("dtype", "float32"), **kw))


def state(loaded) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loaded.model.state_dict().items()}


def same_weights(a, b) -> bool:
    sa, sb = state(a), state(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), arch="llama", seed=0)


@pytest.fixture
def tiny_copy(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir, tmp_path / "copy")


# ------------------------------------------------------------------ sources

def test_default_model_loads_with_metadata_and_progress():
    seen = []
    loaded = load_model(ModelOptions(dtype="bfloat16"),
                        progress=lambda done, total, what: seen.append((done, total)))
    assert loaded.name == DEFAULT_MODEL and loaded.dtype == "bfloat16"
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert not loaded.model.training
    assert loaded.arch.architecture == "LlamaForCausalLM" and loaded.arch.num_layers == 30
    assert loaded.arch.tie_word_embeddings and loaded.max_model_len == 8192
    assert loaded.eos_token_ids == (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert "<|im_start|>" in loaded.chat_template
    assert seen[-1] == (272, 272) and [d for d, _ in seen] == list(range(1, 273))


def test_gguf_path_and_served_name():
    loaded = load(str(default_gguf_path()), served_model_name="smol")
    assert loaded.name == "smol" and loaded.arch.vocab_size == len(loaded.tokenizer)


def test_hf_directory(tiny_dir):
    loaded = load(str(tiny_dir))
    assert loaded.arch.architecture == "LlamaForCausalLM"
    assert loaded.name == tiny_dir.name and loaded.max_model_len == 1024
    assert loaded.eos_token_ids == (2,)
    assert loaded.tokenizer.encode("Hello world") == [19556, 905]


def test_sharded_safetensors_load_the_same_weights(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(tiny_dir), local_files_only=True).save_pretrained(
        sharded, max_shard_size="1MB")
    for f in tiny_dir.glob("tokenizer*"):
        shutil.copy(f, sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert same_weights(load(str(sharded)), load(str(tiny_dir)))


def test_random_weights_follow_the_seed(tiny_dir):
    a, b, c = load(f"random:{tiny_dir}", seed=1), load(f"random:{tiny_dir}/config.json", seed=1), \
        load(f"random:{tiny_dir}", seed=2)
    assert same_weights(a, b) and not same_weights(a, c)
    assert a.name == f"random-{tiny_dir.name}"
    assert all(torch.isfinite(p).all() for p in a.model.parameters())


def test_random_without_tokenizer_uses_the_default_one(tmp_path, tiny_dir):
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    loaded = load(f"random:{tmp_path / 'config.json'}", dtype="bfloat16")
    assert loaded.tokenizer.encode("Hello world") == [19556, 905]
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_mistral_context_is_capped_at_its_window(tmp_path):
    d = make_tiny_model_dir(tmp_path, arch="mistral", sliding_window=256)
    assert load(f"random:{d}").max_model_len == 256


# ------------------------------------------------------------------ errors

def expect_error(model: str, *fragments: str, **kw) -> str:
    with pytest.raises(ModelLoadError) as e:
        load(model, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_unknown_architecture(tiny_copy):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    expect_error(str(tiny_copy), "GPT2LMHeadModel", "LlamaForCausalLM")
    expect_error(f"random:{tiny_copy}", "GPT2LMHeadModel")


def test_unsupported_rope_type(tiny_copy):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    expect_error(str(tiny_copy), "yarn")


def test_missing_paths(tmp_path):
    expect_error(str(tmp_path / "nope"), "does not exist")
    expect_error(str(tmp_path / "nope.gguf"), "does not exist")
    expect_error("HuggingFaceTB/SmolLM2-135M", "does not exist")  # never a download
    expect_error(f"random:{tmp_path}", "config.json")
    expect_error(str(tmp_path), "config.json")


def test_missing_pieces_of_a_directory(tiny_copy):
    (tiny_copy / "model.safetensors").rename(tiny_copy / "weights.bin")
    expect_error(str(tiny_copy), "no *.safetensors")
    (tiny_copy / "weights.bin").rename(tiny_copy / "model.safetensors")
    for f in tiny_copy.glob("tokenizer*"):
        f.unlink()
    expect_error(str(tiny_copy), "tokenizer")


def test_missing_tensor(tiny_copy):
    f = tiny_copy / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    expect_error(str(tiny_copy), "lacks", "model.layers.1.mlp.gate_up_proj.weight")


def test_wrong_shape(tiny_copy):
    f = tiny_copy / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(f), metadata={"format": "pt"})
    expect_error(str(tiny_copy), "model.norm.weight", "shape")


@pytest.mark.parametrize("keep", [0.5, 0.999, 10])
def test_truncated_safetensors(tiny_copy, keep):
    f = tiny_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * keep)] if keep < 1 else data[:keep])
    expect_error(str(tiny_copy), "model.safetensors", "corrupt")


def test_missing_shard(tiny_copy):
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(str(tiny_copy), "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("keep", [1000, 0.6])
def test_truncated_gguf(tmp_path, keep):
    data = default_gguf_path().read_bytes()
    f = tmp_path / "cut.gguf"
    f.write_bytes(data[:keep] if keep > 1 else data[:int(len(data) * keep)])
    expect_error(str(f), "cut.gguf", "GGUF")


def test_not_a_gguf(tmp_path):
    f = tmp_path / "junk.gguf"
    f.write_bytes(b"definitely not a model" * 10)
    expect_error(str(f), "junk.gguf", "magic")


def test_bad_dtype(tiny_dir):
    expect_error(str(tiny_dir), "float16", dtype="float16")


# ------------------------------------------------------------------ config.json without transformers

def _reading(cfg):
    from kvrelay.engine.loader import _max_model_len, arch_from_hf_config
    try:
        arch = arch_from_hf_config(cfg)
    except ModelLoadError as exc:
        return str(exc)
    return (arch, _max_model_len(arch, cfg), getattr(cfg, "eos_token_id", None),
            getattr(cfg, "initializer_range", 0.02))


def _variants(raw: dict):
    """The config as written, each field left out in turn, and the rope spelled other ways."""
    yield "as written", raw
    for key in raw:
        if key != "model_type":
            yield f"without {key}", {k: v for k, v in raw.items() if k != key}
    theta = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    bare = {k: v for k, v in raw.items() if k != "rope_parameters"}
    yield "top-level rope_theta", {**bare, "rope_theta": theta * 2}
    yield "rope_scaling default", {**bare, "rope_theta": 5e5, "rope_scaling": {"type": "default"}}
    yield "rope_scaling linear", {**bare, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    yield "rope_scaling null", {**bare, "rope_scaling": None}
    yield "sliding window", {**raw, "use_sliding_window": True, "sliding_window": 64}
    yield "window null", {**raw, "sliding_window": None}
    yield "partial rotary", {**raw, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_config_json_reads_as_transformers_reads_it(arch, tmp_path):
    """kvrelay reads a config.json that states its fields without transformers' config
    classes (they cost seconds at every worker start): every variant gives the same
    architecture, context length, EOS and init range as AutoConfig, and the file as
    transformers writes it takes that fast reading."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from kvrelay.engine.loader import _hf_config

    raw = json.loads((make_tiny_model_dir(tmp_path / "m", arch=arch) / "config.json").read_text())
    path = tmp_path / "config.json"
    stated = 0
    for what, cfg in _variants(raw):
        path.write_text(json.dumps(cfg))
        try:
            ours = _hf_config(path)
            stated += isinstance(ours, SimpleNamespace)
            ours = _reading(ours)
        except ModelLoadError as exc:
            ours = str(exc)
        try:
            theirs = _reading(AutoConfig.from_pretrained(str(path), local_files_only=True))
        except Exception:   # transformers refuses the file: kvrelay must refuse to serve it too
            assert isinstance(ours, str), what
        else:
            assert ours == theirs, what
    path.write_text(json.dumps(raw))
    assert isinstance(_hf_config(path), SimpleNamespace)
    assert stated >= 5


def test_the_default_gguf_reads_as_transformers_config_class_reads_it(monkeypatch):
    """The default model's GGUF metadata states every field: kvrelay reads it without
    transformers' config classes (seconds at every worker start), and that reading gives the
    same architecture, context length, EOS and init range as the class would."""
    from types import SimpleNamespace

    from kvrelay.engine import loader

    path = default_gguf_path()
    reader = loader._open_gguf(path)
    ours = loader._gguf_hf_config(reader, path)
    assert isinstance(ours, SimpleNamespace)
    monkeypatch.setattr(loader, "_stated_config", lambda raw: None)
    theirs = loader._gguf_hf_config(reader, path)
    assert not isinstance(theirs, SimpleNamespace)
    assert _reading(ours) == _reading(theirs)
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings


def test_a_gguf_tokenizer_is_converted_once_and_the_cached_one_is_the_same(tmp_path, monkeypatch):
    """The first start converts the GGUF vocabulary and keeps the result; the next loads that,
    and it tokenizes, detokenizes and templates exactly as the converted one. A damaged entry
    is converted again; an unwritable cache directory only means converting every time."""
    from kvrelay.engine import tokenizer_cache
    from kvrelay.engine.sources import auto_tokenizer

    path = default_gguf_path()
    st = path.stat()
    stamp = (st.st_size, st.st_mtime_ns)
    converted = []

    def convert():
        converted.append(1)
        return auto_tokenizer(path.parent, gguf_file=path.name)

    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    fresh = tokenizer_cache.load_or_convert(path, stamp, convert)
    cached = tokenizer_cache.load_or_convert(path, stamp, convert)
    assert len(converted) == 1 and cached is not fresh
    texts = ["Hello world", "  spaces  and\ttabs\n", "héllo ñ 日本語 🙂", "<|im_start|>user\nhi<|im_end|>",
             "def f(x):\n    return x"]
    for text in texts:
        ids = fresh.encode(text)
        assert cached.encode(text) == ids and cached.decode(ids) == fresh.decode(ids)
        assert cached.decode(ids, skip_special_tokens=True) == fresh.decode(ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (cached.all_special_tokens, cached.eos_token_id, cached.bos_token_id, len(cached)) == \
        (fresh.all_special_tokens, fresh.eos_token_id, fresh.bos_token_id, len(fresh))

    entry = tokenizer_cache.entry_for(path, stamp)
    (entry / "tokenizer.json").write_text("{not json")
    assert tokenizer_cache.load_or_convert(path, stamp, convert).encode(texts[0]) == fresh.encode(texts[0])
    assert len(converted) == 2 and json.loads((entry / "tokenizer.json").read_text())   # written again
    assert tokenizer_cache.entry_for(path, (stamp[0], stamp[1] + 1)) != entry           # a changed file: a new key

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "file"))                      # cannot hold a directory
    assert tokenizer_cache.load_or_convert(path, stamp, convert).encode(texts[0]) == fresh.encode(texts[0])
    assert len(converted) == 3


def test_a_start_imports_only_what_it_needs(tiny_dir):
    """The router's tokenizer comes without torch, and a worker's model load without
    torch._dynamo, torch.distributed or sympy (each costs up to seconds at every start on a
    small CPU)."""
    import subprocess
    import sys

    script = f"""
import sys
from kvrelay.core.config import ModelOptions
from kvrelay.server.router import router_tokenizer
tok = router_tokenizer(ModelOptions(model="random:{tiny_dir}"))
print(type(tok).__name__, "torch" in sys.modules)
from kvrelay.engine.loader import load_model
loaded = load_model(ModelOptions(model="random:{tiny_dir}", dtype="float32"))
print(loaded.arch.architecture, sorted(m for m in ("torch._dynamo", "torch.distributed.tensor", "sympy") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["TokenizersBackend False", "LlamaForCausalLM []"]

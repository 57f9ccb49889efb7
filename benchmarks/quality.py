"""Quality of each weight format against bfloat16, computed by kvrelay's own engine.

Perplexity: the first --max-tokens tokens of --text, scored in windows of --window tokens
(each window from its own start, no context carried over) by one forward pass of the
model per window, logits at every position. The default text is natural English prose
that ships in a PyPI package kvrelay's venv installs: litellm's Codex CLI instructions
(litellm==1.110.2, requirements-clients.txt), written after SmolLM2 was trained, so the
model cannot have memorised it.

Agreement with the bfloat16 reference:
- top-1 (text): fraction of the text's positions whose argmax equals the reference's
  (teacher-forced, so one early difference does not compound);
- greedy prefix / overall: PROMPTS (20 chat questions) x --new-tokens greedy tokens with
  ignore_eos, batched through EngineCore as the server runs them; prefix is the mean
  fraction of each answer before its first token that differs from the reference's,
  overall the fraction of all positions whose tokens are equal.

weights MB: the weights in their stored format, one copy (quantized blocks and scales, else
the stored width); held MB: every weight tensor the loaded model holds, the layouts packed
for the kernels included, each storage once: the memory the weights take.

  python benchmarks/quality.py                            # bf16 vs float32, int8, int4, gguf
  python benchmarks/quality.py --formats fp32,auto,auto-kv-fp32   # the bfloat16 KV cache
  python benchmarks/quality.py --formats int4 --kernels avx2 --json
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

from kvrelay.core.config import DEFAULT_MODEL, KVCacheConfig, ModelOptions, SchedulerConfig
from kvrelay.engine.attention import make_attention_backend
from kvrelay.engine.core import EngineCore, kv_layout_for
from kvrelay.engine.kv_pool import KVPool
from kvrelay.engine.loader import ModelLoadError, load_model
from kvrelay.engine.models.linear import Linear
from kvrelay.engine.runner import SeqChunk, build_forward_batch
from kvrelay.engine.types import GenerateRequest, SamplingParams

TEXT_PACKAGE, TEXT_FILE = "litellm", "proxy/common_utils/codex_base_instructions.md"
REFERENCE = "bf16"
# format name -> (dtype, quantization, lm-head quantization, KV cache dtype); None: the --dtype
# flag (auto by default). int8/int4/gguf keep the head as --lm-head-quantization auto does
# (int8, int8, the file's blocks); the "head-..." variants set it. "auto" is what `kvrelay
# serve` runs with its defaults (on a CPU without AVX-512 BF16: float32 compute, bfloat16
# weights and KV cache); "auto-kv-fp32" the same with a float32 KV cache.
FORMATS = {"bf16": ("bfloat16", "none", "auto", "auto"), "fp32": ("float32", "none", "auto", "auto"),
           "auto": ("auto", "none", "auto", "auto"), "auto-kv-fp32": ("auto", "none", "auto", "float32"),
           "int8": (None, "int8", "auto", "auto"), "int4": (None, "int4", "auto", "auto"),
           "gguf": (None, "gguf", "auto", "auto"),
           "int4-head-float": (None, "int4", "none", "auto"), "int4-head-int4": (None, "int4", "int4", "auto")}
PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three primary colours.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU cache do?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "What is 12 times 7?",
    "Describe a cat to someone who has never seen one.",
    "Name a famous painting and its painter.",
    "What causes the seasons on Earth?",
    "Suggest a name for a bakery.",
    "What is the difference between weather and climate?",
    "Summarise the story of Cinderella.",
    "How do vaccines work?",
    "What should I pack for a weekend hike?",
    "Tell me a fun fact about octopuses.",
]


@dataclasses.dataclass
class Run:
    """What one format produced; `error` set when it could not be loaded or run."""
    name: str
    dtype: str = ""
    weights: str = ""
    kv_cache: str = ""
    kernels: str = ""
    weight_mb: float = 0.0                     # the stored format, one copy
    held_mb: float = 0.0                       # every copy the model holds (packed layouts too)
    perplexity: float = math.nan
    argmax: torch.Tensor | None = None         # [positions] the text's top-1 tokens
    greedy: list[list[int]] | None = None      # per prompt, the generated tokens
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)   # phase -> wall seconds
    error: str | None = None


def default_text() -> Path:
    # find_spec locates the package without importing it (litellm takes seconds to import).
    spec = importlib.util.find_spec(TEXT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the default text ships in {TEXT_PACKAGE}: pip install -r requirements-clients.txt, "
                         "or pass --text FILE")
    return Path(list(spec.submodule_search_locations)[0]) / TEXT_FILE


_HELD = ("quant", "packed", "_head_packed")   # what a module keeps besides its parameters


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight tensor the model holds, each storage once."""
    return weight_bytes_of(model)


def weight_bytes_of(root) -> int:
    seen: set[int] = set()

    def size(obj, depth: int = 0) -> int:
        if isinstance(obj, torch.Tensor):
            try:
                key = obj.data_ptr()
            except RuntimeError:   # an opaque oneDNN layout has no data pointer
                key = id(obj)
            if obj.numel() == 0 or key in seen:
                return 0
            seen.add(key)
            return obj.numel() * obj.element_size()
        if hasattr(obj, "nbytes") and hasattr(obj, "dtype"):   # a numpy array
            return int(obj.nbytes)
        if depth > 3:
            return 0
        if isinstance(obj, (list, tuple)):
            return sum(size(o, depth + 1) for o in obj)
        if dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            names = ([f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj)
                     else list(getattr(obj, "__dict__", {})) or list(getattr(obj, "__slots__", ())))
            return sum(size(getattr(obj, n, None), depth + 1) for n in names)
        return 0

    if not isinstance(root, torch.nn.Module):
        return size(root)
    total = sum(size(p) for p in root.parameters())
    return total + sum(size(getattr(m, a, None)) for m in root.modules() for a in _HELD)


def format_bytes(model: torch.nn.Module, store: str) -> int:
    """Bytes of the weights in their stored format, one copy: a quantized Linear's own
    tensors, any other Linear at `store`'s width (bf16: 2 bytes), every other parameter as is,
    and a tied head's own quantized copy."""
    store = store.split(",")[0]   # "int4, lm_head int8": the head is a quantized Linear or copy
    head = getattr(model, "_head_quant", None)
    total = weight_bytes_of(head) if head is not None else 0
    for m in model.modules():
        own = [p for p in m.parameters(recurse=False) if p.numel()]
        if isinstance(m, Linear):
            own = [b for b in (m.bias,) if b is not None]
            if m.quant is not None:
                total += weight_bytes_of(m.quant)
            else:
                width = 2 if store == "bf16" else m.weight.element_size()
                total += m.in_features * m.out_features * width
        total += sum(p.numel() * p.element_size() for p in own)
    return total


def window_logits(loaded, kv: KVPool, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] at every position of one sequence, one forward pass."""
    page = kv.layout.page_size
    batch = build_forward_batch([SeqChunk(ids, 0, list(range(1, 1 + -(-len(ids) // page))))], page)
    batch = dataclasses.replace(batch, logits_index=torch.arange(len(ids)))
    return loaded.model(batch, make_attention_backend(loaded.attention_backend, kv, loaded.arch.num_heads))


def score_text(loaded, ids: list[int], window: int, kv_dtype: str) -> tuple[float, torch.Tensor]:
    """(perplexity, argmax at every predicted position) over `ids` in windows."""
    page = 16
    kv = KVPool(kv_layout_for(loaded, page, kv_dtype), 1 + -(-window // page))   # page 0 pads the batch
    nll, count, tops = 0.0, 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        logits = window_logits(loaded, kv, chunk)[:-1]
        target = torch.tensor(chunk[1:])
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(target)
        tops.append(logits.argmax(-1))
    return math.exp(nll / count), torch.cat(tops)


def chat_prompts(tokenizer) -> list[list[int]]:
    out = []
    for q in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def greedy_tokens(loaded, prompts: list[list[int]], new_tokens: int, kv_dtype: str) -> list[list[int]]:
    """Greedy continuations, all requests batched through the engine loop."""
    longest = max(len(p) for p in prompts) + new_tokens
    core = EngineCore(loaded, KVCacheConfig(page_size=16, max_kv_tokens=len(prompts) * (longest + 16),
                                            kv_cache_dtype=kv_dtype), SchedulerConfig())
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    errors: list[str] = []

    def sink_for(i: int):
        def sink(out) -> None:
            outs[i].extend(out.token_ids)
            if out.error:
                errors.append(out.error)
        return sink

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add(GenerateRequest(f"q{i}", tuple(p), params), sink_for(i))
    while core.has_work:
        core.step()
    core.check_idle()
    if errors:
        raise RuntimeError(f"generation failed: {errors[0]}")
    return [outs[i] for i in range(len(prompts))]


def run_format(name: str, args, ids: list[int]) -> Run:
    dtype, quant, head, kv_dtype = FORMATS[name]
    run, clock = Run(name), time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        run.seconds[phase], clock = round(time.perf_counter() - clock, 1), time.perf_counter()

    try:
        loaded = load_model(ModelOptions(model=args.model, dtype=dtype or args.dtype, quantization=quant,
                                         lm_head_quantization=head, kernels=args.kernels))
        run.dtype, run.weights, run.kernels = loaded.dtype, loaded.weights, loaded.kernels
        run.kv_cache = kv_layout_for(loaded, 16, kv_dtype).kv_dtype
        run.weight_mb = format_bytes(loaded.model, loaded.weights) / 1e6
        run.held_mb = weight_bytes(loaded.model) / 1e6
        lap("load")
        run.perplexity, run.argmax = score_text(loaded, ids, args.window, kv_dtype)
        lap("perplexity")
        run.greedy = greedy_tokens(loaded, chat_prompts(loaded.tokenizer), args.new_tokens, kv_dtype)
        lap("greedy")
    except (ModelLoadError, NotImplementedError, RuntimeError) as exc:
        run.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        loaded = None
        gc.collect()
    print(f"# {name}: {run.seconds} s{'  ' + run.error if run.error else ''}", file=sys.stderr)
    return run


def agreement(run: Run, ref: Run) -> dict[str, float]:
    if run.error or ref.error:
        return {"top1_text": math.nan, "greedy_prefix": math.nan, "greedy_overall": math.nan}
    prefix, equal, total = [], 0, 0
    for mine, theirs in zip(run.greedy, ref.greedy):
        same = [a == b for a, b in zip(mine, theirs)]
        prefix.append((same.index(False) if False in same else len(same)) / len(theirs))
        equal, total = equal + sum(same), total + len(theirs)
    return {"top1_text": (run.argmax == ref.argmax).float().mean().item(),
            "greedy_prefix": sum(prefix) / len(prefix), "greedy_overall": equal / total}


def row(run: Run, ref: Run) -> dict:
    return {"format": run.name, "dtype": run.dtype, "weights": run.weights, "kv_cache": run.kv_cache,
            "kernels": run.kernels,
            "weight_mb": round(run.weight_mb, 1), "held_mb": round(run.held_mb, 1),
            "perplexity": run.perplexity, **agreement(run, ref),
            "seconds": run.seconds, "error": run.error}


def print_table(rows: list[dict], source: str, n_tokens: int, args) -> None:
    print(f"Perplexity over {n_tokens} tokens of {source} (windows of {args.window}); "
          f"agreement with {REFERENCE} over {len(PROMPTS)} prompts x {args.new_tokens} greedy tokens.\n")
    print("| format | compute | KV cache | weights MB | held MB | perplexity | top-1 = bf16 (text) "
          "| greedy prefix = bf16 | greedy overall = bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["error"]:
            print(f"| {r['format']} | n/a | | | | | | | {r['error']} |")
            continue
        print(f"| {r['format']} | {r['dtype']}, {r['kernels']} | {r['kv_cache']} | {r['weight_mb']:.0f} "
              f"| {r['held_mb']:.0f} "
              f"| {r['perplexity']:.3f} "
              f"| {r['top1_text']:.1%} | {r['greedy_prefix']:.1%} | {r['greedy_overall']:.1%} |")


def text_ids(tokenizer, path: Path, max_tokens: int) -> list[int]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SystemExit(f"cannot read --text {path}: {exc.strerror}") from None
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    if len(ids) < 2:
        raise SystemExit(f"--text {path} has fewer than 2 tokens")
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--formats", default="fp32,int8,int4,gguf",
                    help=f"comma-separated, compared with {REFERENCE}: "
                         f"{', '.join(f for f in FORMATS if f != REFERENCE)}")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="compute dtype of the quantized formats (bf16 and fp32 fix their own)")
    ap.add_argument("--kernels", default="auto", help="native kernel variant, as `kvrelay serve --kernels`")
    ap.add_argument("--text", type=Path, help="UTF-8 text file (default: litellm's Codex CLI instructions)")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a markdown table")
    args = ap.parse_args()
    names = [REFERENCE] + [f for f in args.formats.split(",") if f and f != REFERENCE]
    unknown = [f for f in names if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown format {unknown[0]!r}; choose from {', '.join(FORMATS)}")
    path = args.text or default_text()
    from kvrelay.engine.loader import load_tokenizer
    ids = text_ids(load_tokenizer(ModelOptions(model=args.model)), path, args.max_tokens)
    runs = [run_format(n, args, ids) for n in names]
    rows = [row(r, runs[0]) for r in runs]
    if runs[0].error:
        raise SystemExit(f"the {REFERENCE} reference failed: {runs[0].error}")
    source = f"{TEXT_PACKAGE}/{TEXT_FILE}" if args.text is None else str(path)
    if args.json:
        print(json.dumps({"text": source, "tokens": len(ids), "rows": rows}, indent=2))
    else:
        print_table(rows, source, len(ids), args)


if __name__ == "__main__":
    main()

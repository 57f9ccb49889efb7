#!/usr/bin/env bash
# Run here (any machine with PyPI and `make test`'s .venv) before a session on the lent GPU
# machine, where nothing can be downloaded. Writes .gpu/ (git-ignored, ~45 MB), which the
# device tool carries: `run(command="bash benchmarks/gpu/check.sh", carry=[".gpu"])`.
#   .gpu/wheels     the packages that machine lacks (its python3 is 3.12 and holds torch,
#                   triton, numpy, pytest, matplotlib, httpx, rich, ...): pinned as here
#   .gpu/tokenizer  the default model's tokenizer as files (its 94 MB package cannot travel)
#   .gpu/models/smollm2-shape  the default model's config + tokenizer: served with random
#                   weights (`random:`), it computes exactly what the real weights cost
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
test -x $PY || { echo "run 'make test' first: it builds .venv" >&2; exit 1; }
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/models
pin() { grep -hE "^$1==" requirements.txt requirements-test.txt | head -1; }
# Runtime and test packages the GPU image lacks or holds in other versions (KINDS.md of the
# device tool lists what it holds), and the dependencies of those that it lacks too.
WANT="$(for p in transformers tokenizers huggingface_hub gguf llguidance fastapi uvicorn httptools pyzmq \
          pydantic openai jsonschema; do pin $p; done) starlette==1.10.0 pydantic_core==2.50.5 \
      annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 jiter==0.19.0 distro==1.9.0 \
      sniffio==1.3.1 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 attrs==26.1.0"
$PY -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps --implementation cp \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform any \
    -d .gpu/wheels $WANT 2>&1 | grep -v "^WARNING: Location" || true
ls .gpu/wheels/*.whl >/dev/null
$PY - <<'PY'
from pathlib import Path

from transformers import AutoConfig

from kvrelay.engine.sources import default_gguf_path, default_tokenizer

tok = default_tokenizer()
tok.save_pretrained(".gpu/tokenizer")
gguf = default_gguf_path()
cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
cfg.architectures = ["LlamaForCausalLM"]
out = Path(".gpu/models/smollm2-shape")
cfg.save_pretrained(out)
tok.save_pretrained(out)
PY
du -sh .gpu .gpu/wheels

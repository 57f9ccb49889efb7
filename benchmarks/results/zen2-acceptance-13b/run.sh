#!/bin/bash
# #13 (a)/(b) on an avx2 Zen 2 after the AVX2 matmul and decode-attention kernels (f62ba39): kvrelay defaults (serve 1P+1D) and colocated against vLLM-CPU float32
# (its better dtype on this chip: bfloat16 is emulated, 3.1-3.2 s an output token in
# zen2-acceptance-14), VLLM_CPU_OMP_THREADS_BIND=0-1, --max-model-len 2048;
# 3 alternated rounds, --warmup 4, --settle 5 (default).
cd "$(dirname "$0")/../../.."
out=benchmarks/results/zen2-acceptance-13b; mkdir -p $out
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
bash benchmarks/results/epyc-vs-vllm-llamacpp/vllm.sh 8202 float32 0-1 $out/server-vllm-fp32.log &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
for u in 8220 8210 8202; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
for w in a b; do
  .venv/bin/python -m kvrelay bench --compare serve=http://127.0.0.1:8220 colocated=http://127.0.0.1:8210 \
     vllm_fp32=http://127.0.0.1:8202 --workload $w --rounds 3 --warmup 4 \
     --no-progress --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve'
pkill -f 'vllm.entrypoints'
echo done

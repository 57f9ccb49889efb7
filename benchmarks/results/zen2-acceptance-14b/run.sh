#!/bin/bash
# #14's (d) on an avx2 Zen 2 in one run against vLLM-CPU's better dtype here (float32;
# bfloat16 is emulated: 3.1-3.2 s an output token in zen2-acceptance-14), on both cores
# (VLLM_CPU_OMP_THREADS_BIND=0-1), --max-model-len 4096 ((d)'s prompts reach 2,048 tokens);
# colocated kvrelay and `kvrelay serve` (1P+1D, defaults); all up at once, 3 alternated
# rounds, --settle 5.
cd "$(dirname "$0")/../../.."
out=benchmarks/results/zen2-acceptance-14b; mkdir -p $out
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \
  /work/peers/vllm/bin/python -m vllm.entrypoints.openai.api_server \
    --model /work/peers/models/SmolLM2-135M-Instruct --served-model-name SmolLM2-135M-Instruct \
    --dtype float32 --max-model-len 4096 --host 127.0.0.1 --port 8202 > $out/server-vllm-fp32.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
for u in 8210 8220 8202; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare colocated=http://127.0.0.1:8210 vllm_fp32=http://127.0.0.1:8202 \
   serve=http://127.0.0.1:8220 --workload mixed --rounds 3 --settle 5 --no-progress --result-dir $out/d > $out/bench-d.txt 2>&1
for p in 8230 8231; do echo "== $p"; curl -s http://127.0.0.1:$p/metrics | grep -E "^kvrelay_(request_finished|transfer|phase_duration_seconds_(count|sum))"; done > $out/worker-metrics-after-d.txt
pkill -f 'kvrelay serve'
pkill -f 'vllm.entrypoints'
echo done

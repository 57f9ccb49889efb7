#!/bin/bash
# #14 acceptance, second sitting: the same servers, kvrelay bench --settle 5 (the default now):
# each run waits for a quiet host (vLLM-CPU keeps a core busy ~1 s after its last answer).
cd /work/main
out=benchmarks/results/epyc-acceptance-14/settled; mkdir -p $out
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=auto \
  nohup /work/peers/vllm/bin/python -m vllm.entrypoints.openai.api_server \
    --model /work/peers/models/SmolLM2-135M-Instruct --served-model-name SmolLM2-135M-Instruct \
    --dtype bfloat16 --max-model-len 4096 --host 127.0.0.1 --port 8201 > $out/server-vllm-bf16.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
(cd /work/before && /work/main/.venv/bin/python -m kvrelay serve --mode colocated --port 8211 > $out/server-before-c45fe6d.log 2>&1) &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
for u in 8210 8211 8220 8201; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare colocated=http://127.0.0.1:8210 vllm_bf16=http://127.0.0.1:8201 \
   serve=http://127.0.0.1:8220 --workload mixed --rounds 3 --no-progress --result-dir $out/d > $out/bench-d.txt 2>&1
for p in 8230 8231; do echo "== $p"; curl -s http://127.0.0.1:$p/metrics | grep -E "^kvrelay_(engine|request_finished|transfer|phase_duration_seconds)" ; done > $out/worker-metrics-after-d.txt
.venv/bin/python -m kvrelay bench --compare colocated=http://127.0.0.1:8210 before_c45fe6d=http://127.0.0.1:8211 \
   vllm_bf16=http://127.0.0.1:8201 serve=http://127.0.0.1:8220 --workload a --rounds 3 --warmup 4 \
   --no-progress --result-dir $out/a > $out/bench-a.txt 2>&1
pkill -f 'kvrelay serve'
pkill -f 'vllm.entrypoints'
echo done

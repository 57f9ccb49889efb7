#!/bin/bash
# #14 acceptance on an avx2 Zen 2: one sitting, all servers up at once, `--settle 5`.
# (d): colocated, vLLM bf16, serve (1P+1D), 3 alternated rounds; colocated at c45fe6d
# (before #14, from a worktree) starts here too, for run2.sh's (a)(b)(c).
cd /work/main
out=/work/main/benchmarks/results/zen2-acceptance-14; mkdir -p $out
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=auto \
  nohup /work/peers/vllm/bin/python -m vllm.entrypoints.openai.api_server \
    --model /work/peers/models/SmolLM2-135M-Instruct --served-model-name SmolLM2-135M-Instruct \
    --dtype bfloat16 --max-model-len 4096 --host 127.0.0.1 --port 8201 > $out/server-vllm-bf16.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
(cd /work/before && /work/main/.venv/bin/python -m kvrelay serve --mode colocated --port 8211 > $out/server-before-c45fe6d.log 2>&1) &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
for u in 8210 8211 8220 8201; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
for u in 8210 8211 8220; do curl -s http://127.0.0.1:$u/health; echo; done > $out/health.txt
.venv/bin/python -m kvrelay bench --compare colocated=http://127.0.0.1:8210 vllm_bf16=http://127.0.0.1:8201 \
   serve=http://127.0.0.1:8220 --workload mixed --rounds 3 --settle 5 --no-progress --result-dir $out/d > $out/bench-d.txt 2>&1
for p in 8230 8231; do echo "== $p"; curl -s http://127.0.0.1:$p/metrics | grep -E "^kvrelay_(engine|request_finished|transfer|phase_duration_seconds_(count|sum))" ; done > $out/worker-metrics-after-d.txt
# The (d) run above ended here: run2.sh stopped vLLM and ran (a)-(c) and the 8,000-token prompt.

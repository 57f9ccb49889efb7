#!/bin/bash
# #14 acceptance on an avx2 Zen 2: one sitting, all servers up at once, `--settle 5`.
# (d): colocated, vLLM bf16, serve (1P+1D), 3 alternated rounds;
# (a)(b)(c): the same plus colocated at c45fe6d (before #14) from a worktree, 3 rounds each;
# then one 8,000-token prompt at a time through serve, layer-wise transfer on against off.
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
for w in a b c; do
  .venv/bin/python -m kvrelay bench --compare colocated=http://127.0.0.1:8210 before_c45fe6d=http://127.0.0.1:8211 \
     vllm_bf16=http://127.0.0.1:8201 serve=http://127.0.0.1:8220 --workload $w --rounds 3 --warmup 4 --settle 5 \
     --no-progress --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve'
pkill -f 'vllm.entrypoints'
sleep 5
mkdir -p $out/long
.venv/bin/python -m kvrelay serve --port 8240 --worker-base-port 8250 > $out/long/server-layerwise.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8260 --worker-base-port 8270 --no-layerwise-transfer > $out/long/server-no-layerwise.log 2>&1 &
for u in 8240 8260; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare layerwise=http://127.0.0.1:8240 no_layerwise=http://127.0.0.1:8260 \
   --workload a --prompt-len 8000 --output-len 16 --num-requests 2 --max-concurrency 1 --rounds 3 --warmup 1 \
   --settle 5 --no-progress --result-dir $out/long > $out/long/bench-8k.txt 2>&1
for p in 8250 8270; do echo "== prefill worker $p"; curl -s http://127.0.0.1:$p/metrics | grep -E '^kvrelay_(phase_duration_seconds_(sum|count)|transfer_ahead_bytes_total|transfer_bytes)' ; done > $out/long/prefill-metrics.txt
pkill -f 'kvrelay serve'
echo done

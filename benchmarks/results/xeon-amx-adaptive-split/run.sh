#!/bin/bash
# (d): colocated vs serve vs serve --decode-prefill-ttft 1 vs vLLM bf16, alternating rounds
cd /work/main
out=/work/bench/split; mkdir -p $out
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=auto \
  nohup /work/peers/vllm/bin/python -m vllm.entrypoints.openai.api_server \
    --model /work/peers/models/SmolLM2-135M-Instruct --served-model-name SmolLM2-135M-Instruct \
    --dtype bfloat16 --max-model-len 2048 --host 127.0.0.1 --port 8201 > $out/vllm.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8240 --worker-base-port 8250 --decode-prefill-ttft 1 > $out/server-split.log 2>&1 &
for u in 8210 8220 8240 8201; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare colocated=http://127.0.0.1:8210 serve=http://127.0.0.1:8220 \
   serve_split1=http://127.0.0.1:8240 vllm_bf16=http://127.0.0.1:8201 --workload mixed --rounds ${ROUNDS:-3} \
   --no-progress --result-dir $out > $out/bench.txt 2>&1
curl -s http://127.0.0.1:8240/metrics | grep prefilled_on_decode > $out/split-metrics.txt
curl -s http://127.0.0.1:8220/metrics | grep prefilled_on_decode >> $out/split-metrics.txt
pkill -f 'kvrelay serve'; pkill -f vllm.entrypoints
echo done

#!/bin/bash
# prefill attention on the tiles: (d) colocated new vs base (dd896c0) vs serve new vs vLLM bf16, then (a)(b)(c)
cd /work/main
out=/work/bench/tiles; mkdir -p $out
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=auto \
  nohup /work/peers/vllm/bin/python -m vllm.entrypoints.openai.api_server \
    --model /work/peers/models/SmolLM2-135M-Instruct --served-model-name SmolLM2-135M-Instruct \
    --dtype bfloat16 --max-model-len 2048 --host 127.0.0.1 --port 8201 > $out/vllm.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-new.log 2>&1 &
(cd /work/base && /work/main/.venv/bin/python -m kvrelay serve --mode colocated --port 8211 > $out/server-base.log 2>&1) &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
for u in 8210 8211 8220 8201; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
curl -s http://127.0.0.1:8210/health > $out/health-new.json
.venv/bin/python -m kvrelay bench --compare kvrelay_new=http://127.0.0.1:8210 kvrelay_dd896c0=http://127.0.0.1:8211 \
   serve_new=http://127.0.0.1:8220 vllm_bf16=http://127.0.0.1:8201 --workload mixed --rounds 3 \
   --no-progress --result-dir $out/d > $out/bench-d.txt 2>&1
for w in a b c; do
  .venv/bin/python -m kvrelay bench --compare kvrelay_new=http://127.0.0.1:8210 kvrelay_dd896c0=http://127.0.0.1:8211 \
     vllm_bf16=http://127.0.0.1:8201 --workload $w --rounds 3 --warmup 4 --no-progress --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve'
pkill -f 'vllm.entrypoints'
echo done

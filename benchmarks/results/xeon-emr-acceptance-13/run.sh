#!/bin/bash
# #13's (a) and (b) on a 2-core Xeon (lscpu model 207, Emerald Rapids: AVX-512 BF16, AMX), one sitting,
# every server started fresh: kvrelay defaults (serve 1P+1D) and colocated at 0c74498 (prefill
# attention on the tiles), `serve` at 8bc2f97 (the commit before it; a worktree in $BASE) and
# vLLM-CPU 0.32.0 bfloat16 (its better dtype on this chip), VLLM_CPU_OMP_THREADS_BIND=0-1.
# 3 alternated rounds, --warmup 2, --settle 5 (default).
cd "$(dirname "$0")/../../.."
out=benchmarks/results/xeon-emr-acceptance-13; mkdir -p $out
BASE=${BASE:-/tmp/base}
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt; git -C $BASE log --oneline -1 >> $out/commit.txt
bash benchmarks/results/epyc-vs-vllm-llamacpp/vllm.sh 8202 bfloat16 0-1 $out/server-vllm-bf16.log &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
(cd $BASE && $OLDPWD/.venv/bin/python -m kvrelay serve --port 8420 --worker-base-port 8430 > $OLDPWD/$out/server-serve-base.log 2>&1) &
for u in 8220 8210 8420 8202; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
for w in b a; do
  .venv/bin/python -m kvrelay bench --compare serve=http://127.0.0.1:8220 colocated=http://127.0.0.1:8210 \
     serve_base=http://127.0.0.1:8420 vllm_bf16=http://127.0.0.1:8202 --workload $w --rounds 3 --warmup 2 \
     --no-progress --result-dir $out/$w > $out/bench-$w.txt 2>&1
done
pkill -f 'kvrelay serve'
pkill -f 'vllm.entrypoints'
echo done

#!/bin/bash
# NEW against OLD (7b2dce3), on the 2-core Zen 4 EPYC (lscpu "AMD EPYC", family 25 model 17).
# First sitting: NEW at 140de27 (prefill attention in runs of query rows, three heads a pass):
# bench-c.txt, bench-b.txt. Second: NEW at b4209b5 (+ the softmax, and the thread count re-read
# between a prefill pass's layers): bench-long-prompt.txt, bench-b-2.txt (3 rounds).
# Each side's servers run from a worktree at its commit (OLD, NEW), all four up at once:
# serve 1P+1D and colocated, defaults. Sitting 1 (SITTING=1): (c) 8 x 1024 -> 256 and (b)
# 32 x 256 -> 128 (--text-prompts, as #13's sitting), 2 alternated rounds; sitting 2 (the
# default): one 2,000-token prompt at a time, 6 rounds, then (b), 3 rounds.
OLD=${OLD:-/work/bench-tree}; NEW=${NEW:-/work/new-tree}
out=$(cd "$(dirname "$0")" && pwd)
lscpu > $out/lscpu.txt; { git -C $OLD log --oneline -1; git -C $NEW log --oneline -1; } > $out/commits.txt
(cd $OLD && .venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > /tmp/old-serve.log 2>&1 &)
(cd $OLD && .venv/bin/python -m kvrelay serve --mode colocated --port 8210 > /tmp/old-colo.log 2>&1 &)
(cd $NEW && .venv/bin/python -m kvrelay serve --port 8320 --worker-base-port 8330 > /tmp/new-serve.log 2>&1 &)
(cd $NEW && .venv/bin/python -m kvrelay serve --mode colocated --port 8310 > /tmp/new-colo.log 2>&1 &)
bash $NEW/benchmarks/results/epyc-vs-vllm-llamacpp/wait.sh 8220 8210 8320 8310
servers="serve_new=http://127.0.0.1:8320 serve_old=http://127.0.0.1:8220 colocated_new=http://127.0.0.1:8310 colocated_old=http://127.0.0.1:8210"
bench() { (cd $NEW && .venv/bin/python -m kvrelay bench --compare $servers --no-progress "$@"); }
if [ "${SITTING:-2}" = 1 ]; then
  bench --workload c --rounds 2 --warmup 2 --result-dir /tmp/pa-c > $out/bench-c.txt 2>&1
  bench --workload b --text-prompts --rounds 2 --warmup 2 --result-dir /tmp/pa-b > $out/bench-b.txt 2>&1
else
  bench --workload a --prompt-len 2000 --output-len 4 --num-requests 1 --rounds 6 --warmup 1 \
      --result-dir /tmp/pa-long > $out/bench-long-prompt.txt 2>&1
  bench --workload b --text-prompts --rounds 3 --warmup 2 --result-dir /tmp/pa-b2 > $out/bench-b-2.txt 2>&1
fi
pkill -f 'kvrelay serve --port 8[23]20'; pkill -f 'kvrelay serve --mode colocated --port 8[23]10'

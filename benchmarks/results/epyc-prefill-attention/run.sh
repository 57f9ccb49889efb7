#!/bin/bash
# Prefill attention in runs of query rows, three heads a pass (fb4a10e, 140de27), against the
# commit before (7b2dce3), on the 2-core Zen 4 EPYC (lscpu "AMD EPYC", family 25 model 17).
# Each side's servers run from a worktree at its commit (OLD, NEW), all four up at once:
# serve 1P+1D and colocated, defaults. Workloads (c) 8 x 1024 -> 256 and (b) 32 x 256 -> 128
# (--text-prompts, as #13's sitting), 2 alternated rounds, --warmup 2.
OLD=${OLD:-/work/bench-tree}; NEW=${NEW:-/work/new-tree}
out=$(cd "$(dirname "$0")" && pwd)
lscpu > $out/lscpu.txt; { git -C $OLD log --oneline -1; git -C $NEW log --oneline -1; } > $out/commits.txt
(cd $OLD && .venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > /tmp/old-serve.log 2>&1 &)
(cd $OLD && .venv/bin/python -m kvrelay serve --mode colocated --port 8210 > /tmp/old-colo.log 2>&1 &)
(cd $NEW && .venv/bin/python -m kvrelay serve --port 8320 --worker-base-port 8330 > /tmp/new-serve.log 2>&1 &)
(cd $NEW && .venv/bin/python -m kvrelay serve --mode colocated --port 8310 > /tmp/new-colo.log 2>&1 &)
bash $NEW/benchmarks/results/epyc-vs-vllm-llamacpp/wait.sh 8220 8210 8320 8310
for w in c b; do
  flags=""; [ $w = b ] && flags=--text-prompts
  (cd $NEW && .venv/bin/python -m kvrelay bench --compare serve_new=http://127.0.0.1:8320 serve_old=http://127.0.0.1:8220 \
     colocated_new=http://127.0.0.1:8310 colocated_old=http://127.0.0.1:8210 --workload $w $flags --rounds 2 --warmup 2 \
     --no-progress --result-dir /tmp/prefill-attention-$w > $out/bench-$w.txt 2>&1)
done
pkill -f 'kvrelay serve --port 8[23]20'; pkill -f 'kvrelay serve --mode colocated --port 8[23]10'

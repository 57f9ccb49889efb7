#!/bin/bash
# (d): kvrelay serve (layer-wise transfer on, the default; cd33a25) vs colocated, both up at once, 3 alternated rounds
out=${OUT:-/work/main/benchmarks/results/epyc-layerwise-serve-d}; mkdir -p $out
cd /work/bt-final   # a worktree at cd33a25: `python -m` imports kvrelay from the working directory
/work/main/.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
/work/main/.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
for u in 8210 8220; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
/work/main/.venv/bin/python -m kvrelay bench --compare serve=http://127.0.0.1:8220 colocated=http://127.0.0.1:8210 \
   --workload mixed --rounds ${ROUNDS:-3} --no-progress --result-dir $out/d > $out/bench-d.txt 2>&1
for p in 8230 8231; do echo "== $p"; curl -s http://127.0.0.1:$p/metrics | grep -E "^kvrelay_engine_yielded|^kvrelay_transfer_" ; done > $out/worker-metrics.txt
pkill -f 'kvrelay serve'
echo done
